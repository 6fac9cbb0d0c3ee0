"""``fs.precompute_float8_scales``: every float8 weight's scale at once, after the step.

See [Note: float8 all-gather] in ``features/float8.py``: the scales left on the fragments make
the next gathers skip the per-unit amax all-reduce. A module of its own because it reads the
model's state (``core/state.py``), which imports the gather path that ``float8.py`` serves.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from flatshard.core.state import get_state
from flatshard.features.float8 import global_amax, require_torchao, to_scales

_STALE_HOOK: list = []  # the optimizer-step hook, registered once (see _forget_after_steps)
_SCALED: weakref.WeakSet = weakref.WeakSet()  # the fragments that carry a precomputed scale


@torch.no_grad()
def precompute_float8_scales(model: nn.Module) -> None:
    """After ``opt.step()``: each float8 weight's scale from its global amax, left on its
    fragment as torchao's ``_precomputed_scale`` so that the next gathers skip the per-unit
    amax all-reduce (one all-reduce per shard group of the model). Every rank must call it.
    The scales hold until the next ``optimizer.step()`` (of any optimizer): the step forgets
    them (the gathers then all-reduce their amax again, every rank alike), so a scale is never
    stale after a step. After ``fs.load``, call it again."""
    require_torchao("fs.precompute_float8_scales")
    _forget_after_steps()
    state = get_state(model)
    by_group: dict[int, tuple[Any, list]] = {}
    for unit in state.units:
        for g in unit.groups:
            if g.float8 is not None:
                entry = by_group.setdefault(id(unit.process_group), (unit.process_group, []))
                entry[1].extend(
                    (s.fragment, g.float8.float8_dtype, tp)
                    for s, tp in zip(g.specs, g.tp, strict=True)
                )
    for process_group, items in by_group.values():  # unit order: the same on every rank
        tp = [t for _, _, t in items]
        amax = global_amax([f for f, _, _ in items], process_group, state.stats, tp)
        scales = to_scales(amax, [d for _, d, _ in items])
        for (fragment, _, _), scale in zip(items, scales, strict=True):
            fragment._precomputed_scale = scale
            _SCALED.add(fragment)


def _forget(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Drop every precomputed scale: O(float8 weights) once after a precompute, O(1) on the
    steps between (no loop over an optimizer's parameters on every step)."""
    for fragment in list(_SCALED):
        fragment._precomputed_scale = None
    _SCALED.clear()


def _forget_after_steps() -> None:
    """Once per process: every optimizer step drops the precomputed scales (a scale from
    before the step would quantize the new weights with the old amax: saturated values,
    silently). Every rank steps, so every rank forgets alike."""
    if not _STALE_HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _STALE_HOOK.append(register_optimizer_step_post_hook(_forget))
