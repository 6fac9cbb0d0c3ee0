"""``fs.precompute_float8_scales``: every float8 weight's scale at once, after the step.

See [Note: float8 all-gather] in ``features/float8.py``: the scales left on the fragments make
the next gathers skip the per-unit amax all-reduce. A module of its own because it reads the
model's state (``core/state.py``), which imports the gather path that ``float8.py`` serves.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flatshard.core.state import get_state
from flatshard.features.float8 import global_amax, require_torchao, to_scales


@torch.no_grad()
def precompute_float8_scales(model: nn.Module) -> None:
    """After ``opt.step()``: each float8 weight's scale from its global amax, left on its
    fragment as torchao's ``_precomputed_scale`` so that the next gathers skip the per-unit
    amax all-reduce (one all-reduce per shard group of the model). Every rank must call it.
    A weight changed later (another step, a load) needs it again, as with torchao on FSDP2."""
    require_torchao("fs.precompute_float8_scales")
    state = get_state(model)
    by_group: dict[int, tuple[Any, list]] = {}
    for unit in state.units:
        for g in unit.groups:
            if g.float8 is not None:
                entry = by_group.setdefault(id(unit.process_group), (unit.process_group, []))
                entry[1].extend((s.fragment, g.float8.float8_dtype) for s in g.specs)
    for process_group, items in by_group.values():  # unit order: the same on every rank
        amax = global_amax([f for f, _ in items], process_group, state.stats)
        scales = to_scales(amax, [d for _, d in items])
        for (fragment, _), scale in zip(items, scales, strict=True):
            fragment._precomputed_scale = scale
