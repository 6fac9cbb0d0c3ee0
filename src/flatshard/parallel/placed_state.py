"""Full state dicts of units sharded over their own mesh (experts): assemble and split the
global tensors from the rank-local ones, using the owning module's ``flatshard_placement``
([Note: per-unit meshes] in parallel/unit_mesh.py).

Such a unit's gathered views hold this rank's block (ep rank ``j``'s experts) only. Saving:
the first rank of each unit mesh (one per block) sends its blocks to the model's first rank,
which puts each at its origin of the global tensor. Loading: the model's first rank
broadcasts each global tensor over the model's mesh and every rank keeps its block.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flatshard.comm.collectives import broadcast
from flatshard.core.state import ShardedState
from flatshard.core.unit import Unit
from flatshard.parallel.unit_mesh import placement


def has_own_mesh(unit: Unit) -> bool:
    return unit.topology.divide_by is not None


def gather_placed(
    model, state: ShardedState, unit: Unit, views, keys: list[tuple[str, int, int]]
) -> dict[str, torch.Tensor]:
    """On the model's first rank: the global tensors of ``unit`` (its ``views`` gathered over
    its own mesh; ``keys``: (name, group, index) of its parameters); ``{}`` elsewhere."""
    pieces = []
    if unit.topology.is_mesh_first:  # one rank per block sends it
        for key, gi, pi in keys:
            shape, origin = _placed(model, key, unit.groups[gi].specs[pi].fragment)
            pieces.append((key, shape, origin, views[gi][pi].detach().to("cpu", copy=True)))
    group = state.topology.mesh_group
    every: list | None = [None] * dist.get_world_size(group) if _is_model_first(state) else None
    dist.gather_object(pieces, every, dst=dist.get_global_rank(group, 0), group=group)
    if every is None:
        return {}
    out: dict[str, torch.Tensor] = {}
    for key, shape, origin, block in (piece for rank in every for piece in rank):
        whole = out.setdefault(key, torch.zeros(shape, dtype=block.dtype))
        region = whole
        for dim, (start, size) in enumerate(zip(origin, block.shape, strict=True)):
            region = region.narrow(dim, start, size)
        region.copy_(block)
    return out


def load_placed_group(model, group, sd: dict, first_key: dict, state: ShardedState) -> None:
    """Fill ``group``'s shard from the global tensors in ``sd`` (held by the model's first
    rank): each is broadcast over the model's mesh and every rank keeps its own block."""
    full = torch.zeros(group.padded_numel, dtype=group.dtype, device=group.device)
    source = _is_model_first(state)
    for spec in group.specs:
        key = first_key[id(spec.fragment)]
        shape, origin = _placed(model, key, spec.fragment)
        whole = sd[key].to(group.device, group.dtype).contiguous() if source else None
        if whole is None:
            whole = torch.empty(shape, dtype=group.dtype, device=group.device)
        broadcast(whole, 0, state.topology.mesh_group, state.stats)
        block = whole
        for dim, (start, size) in enumerate(zip(origin, spec.shape, strict=True)):
            block = block.narrow(dim, start, size)
        full[spec.offset : spec.offset + spec.numel].copy_(block.reshape(-1))
    lo = group.rank * group.shard_numel
    group.shard.copy_(full[lo : lo + group.shard_numel])


def _placed(model, key: str, fragment) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from flatshard.core.params import fragment_tag

    placed = placement(model, key, fragment_tag(fragment))
    assert placed is not None  # only units with their own mesh come here
    return placed


def _is_model_first(state: ShardedState) -> bool:
    return state.topology.is_mesh_first


def placed_shapes(model, refs: dict) -> dict[str, torch.Size]:
    """The global shapes of the parameters whose units have their own mesh, by name."""
    from flatshard.core.params import fragment_tag

    out = {}
    for key, value in refs.items():
        tag = fragment_tag(value) if torch.is_tensor(value) else None
        if tag is not None and (placed := placement(model, key, tag)) is not None:
            out[key] = torch.Size(placed[0])
    return out
