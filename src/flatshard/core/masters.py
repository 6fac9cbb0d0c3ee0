"""The unsharded parameters in the dtype they are *stored* in, for exporting them.

[Note: exports read the masters]
Under mixed precision a unit gathers its shards cast to ``param_dtype`` (bf16): the full
buffer the forward computes with is a rounded copy. Anything that writes parameters out
(``fs.full_state_dict``, ``fs.export_safetensors``, ``fs.save_pretrained``) must write the
fp32 masters instead, so it gathers the shards as they are, into a temporary buffer. Without
mixed precision the compute buffer *is* the master copy and the usual gather serves, unless
the gather is quantized (``fs.Comm(gather=...)``: [Note: quantized weight gather]).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from flatshard.comm.collectives import all_gather_into
from flatshard.core.state import ShardedState
from flatshard.core.unit import ParamState, Unit
from flatshard.features.quantized_gather import applies


@contextmanager
def master_views(state: ShardedState, unit: Unit) -> Iterator[list[list[torch.Tensor]]]:
    """Per flat group of ``unit``, full-shape views of its parameters in the stored dtype,
    valid inside the block. Every rank of the unit's shard group must enter it (it gathers)."""
    wire = unit.stats.gather_wire  # a quantized gather's buffer is not the masters either
    if all(g.compute_dtype == g.dtype and not applies(g, wire) for g in unit.groups):
        was_sharded = unit.state is ParamState.SHARDED
        state.ensure_gathered(unit)
        try:
            yield [g.full_views() for g in unit.groups]
        finally:
            if was_sharded:
                unit.reshard(state.timeout)
        return
    views = []
    for group in unit.groups:
        world = group.padded_numel // group.shard_numel
        full = torch.empty(world * group.shard_numel, dtype=group.dtype, device=state.device)
        shard = group.shard.to(state.device)  # an offloaded shard comes to the device
        all_gather_into(full, shard, unit.process_group, unit.stats, "masters").wait(state.timeout)
        views.append([full[s.offset : s.offset + s.numel].view(s.shape) for s in group.specs])
    yield views
