"""Activation checkpointing that composes with sharding.

``fs.checkpoint_activations(model, policy)`` makes every matched module recompute its forward
during backward instead of keeping its activations (torch's non-reentrant checkpoint around
the module's forward). Every other route (``torch.utils.checkpoint``, torch's composable
``checkpoint``, ``CheckpointWrapper``, Hugging Face's ``gradient_checkpointing_enable``) works
as well; see [Note: recomputation] in ``recompute.py``. Checkpointing one module twice would
recompute it twice per step, so a module already checkpointed by another route is refused.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from flatshard.core.state import get_state
from flatshard.wrap import Policy

MARK = "_flatshard_checkpointed"


def checkpoint_activations(model: nn.Module, policy: Policy) -> int:
    """Recompute the forward of every submodule matched by ``policy`` in backward; returns how
    many modules were wrapped. Call it after ``fs.shard``. ``ValueError`` if nothing matched."""
    get_state(model)  # fs.shard first: the recompute views come from its hooks
    wrapped = 0
    for name, module in model.named_modules():
        if module is model or getattr(module, MARK, False) or not policy(module):
            continue
        if (route := _checkpointed_by(module)) is not None:
            raise ValueError(
                f"checkpoint_activations: {name!r} ({type(module).__name__}) is already "
                f"checkpointed by {route}; checkpointing it twice recomputes it twice per "
                "step. Use one route: drop the other one or this call"
            )
        module.forward = functools.partial(_checkpointed_forward, module.forward)
        setattr(module, MARK, True)
        wrapped += 1
    if wrapped == 0:
        raise ValueError(
            f"checkpoint_activations(policy={policy!r}) matched no submodule of "
            f"{type(model).__name__}; pass e.g. fs.wrap.by_type(YourBlock)"
        )
    return wrapped


def _checkpointed_by(module: nn.Module) -> str | None:
    """The other activation-checkpointing route applied to ``module``, if one is."""
    if type(module).__name__ == "CheckpointWrapper" or hasattr(
        module, "_checkpoint_wrapped_module"
    ):
        return "torch's CheckpointWrapper (apply_activation_checkpointing)"
    if _has_composable(module):
        return "torch.distributed._composable.checkpoint"
    if getattr(module, "gradient_checkpointing", False) is True:
        return "Hugging Face's gradient_checkpointing_enable()"
    return None


def _has_composable(module: nn.Module) -> bool:
    try:
        from torch.distributed._composable.contract import _get_registry
    except ImportError:  # older torch: no registry to ask
        return False
    registry = _get_registry(module)
    return registry is not None and "checkpoint" in registry


def _checkpointed_forward(forward, *args, **kwargs):
    if not torch.is_grad_enabled():  # eval: nothing to save, nothing to recompute
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
