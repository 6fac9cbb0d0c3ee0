"""Activation checkpointing that composes with sharding.

``fs.checkpoint_activations(model, policy)`` makes every matched module recompute its forward
during backward instead of keeping its activations (torch's non-reentrant checkpoint).

[Note: recomputation inside backward]
The recomputation calls the module's forward again, in the middle of backward, so it must see
full parameters. A unit's pre-backward hook (which always fires before any backward node inside
the unit) therefore installs "recompute views": detached full-shape views of the gathered
buffer that require grad (so the recomputed ops save exactly the tensors the first forward
saved), and the unit's post-backward puts the fragments back. Forward hooks that fire *during*
backward (a nested unit called by the recomputed code) only make sure the unit is gathered and
install the same views: no new autograd node, no reshard, no output hooks. Gradients still
flow through the graph of the first forward, to that forward's ``UnitViews`` node.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .api import get_state
from .wrap import Policy

MARK = "_flatshard_checkpointed"


def checkpoint_activations(model: nn.Module, policy: Policy) -> int:
    """Recompute the forward of every submodule matched by ``policy`` in backward; returns how
    many modules were wrapped. Call it after ``fs.shard``. ``ValueError`` if nothing matched."""
    state = get_state(model)
    wrapped = 0
    for module in model.modules():
        if module is model or getattr(module, MARK, False) or not policy(module):
            continue
        module.forward = functools.partial(_checkpointed_forward, module.forward)
        setattr(module, MARK, True)
        wrapped += 1
    if wrapped == 0:
        raise ValueError(
            f"checkpoint_activations(policy={policy!r}) matched no submodule of "
            f"{type(model).__name__}; pass e.g. fs.wrap.by_type(YourBlock)"
        )
    state.recompute_in_backward = True
    return wrapped


def _checkpointed_forward(forward, *args, **kwargs):
    if not torch.is_grad_enabled():  # eval: nothing to save, nothing to recompute
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
