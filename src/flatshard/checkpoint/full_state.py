"""Full (unsharded) state dicts and full parameters on demand.

Both directions go unit by unit, so the device never holds more than one gathered unit beyond
what training already holds. "Rank 0" here is the mesh's first rank (its lowest global rank,
``Topology.is_mesh_first``): the only rank that holds (or reads) the full CPU copy. Every
collective runs on the model's own mesh (see core/mesh.py, "a model talks only to its own
ranks"), so two models on disjoint meshes of one job never wait on each other.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from flatshard.comm.collectives import broadcast
from flatshard.core.masters import master_views
from flatshard.core.params import fragment_tag, full_shape, is_fragment
from flatshard.core.state import ShardedState, StateMode, get_state
from flatshard.core.unit import Unit
from flatshard.features import quantized_gather
from flatshard.parallel.placed_state import (
    gather_placed,
    has_own_mesh,
    load_placed_group,
    placed_shapes,
)
from flatshard.parallel.tensor import full_tensor, is_dtensor, local_part


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The mesh's first rank: full CPU tensors keyed exactly like the unsharded model's
    ``state_dict()`` (tied names included). Other ranks: ``{}``. Every rank of the model's
    mesh must call it (it gathers)."""
    state = get_state(model)
    is_rank0 = state.topology.is_mesh_first
    refs = model.state_dict(keep_vars=True)
    placed_shapes(model, refs)  # every rank: an expert without a placement raises, no hang
    keys_of_unit: dict[int, list[tuple[str, int, int]]] = {}
    for key, value in refs.items():
        if (tag := fragment_tag(value)) is not None:  # where each fragment lives: its tag
            keys_of_unit.setdefault(tag.unit, []).append((key, tag.group, tag.index))
    out: dict[str, torch.Tensor] = {}
    for unit in state.units:  # the fp32 masters under mixed precision, see core/masters.py
        with master_views(state, unit) as views:
            if has_own_mesh(unit):  # experts: this rank's block of each global tensor
                keys = keys_of_unit.get(unit.index, [])
                out.update(gather_placed(model, state, unit, views, keys))
            elif is_rank0:  # with TP, the tp peers of the mesh's first rank gather together
                for key, gi, pi in keys_of_unit.get(unit.index, []):
                    whole = full_tensor(views[gi][pi], unit.groups[gi].tp[pi])
                    out[key] = whole.to("cpu", copy=True)
    if not is_rank0:
        return {}
    for key, value in refs.items():
        if key not in out:
            value = value.full_tensor() if is_dtensor(value) else value  # a DTensor buffer
            out[key] = value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value
    return {key: out[key] for key in refs}


@torch.no_grad()
def load_full_state_dict(model: nn.Module, sd: dict, *, strict: bool = True) -> None:
    """Load a full state dict held by the mesh's first rank (other ranks may pass ``{}``) into
    the shards.

    Every rank of the model's mesh must call it. Shapes and keys are checked on the source
    and a mismatch raises the same ``ValueError`` on every rank (nothing is half-loaded,
    nothing hangs).
    """
    state = get_state(model)
    state.reshard_all()
    is_source = state.topology.is_mesh_first and (state.tp is None or state.tp.is_tp_first)
    refs = model.state_dict(keep_vars=True)
    shapes = {k: full_shape(v) for k, v in refs.items() if torch.is_tensor(v)}
    shapes.update(placed_shapes(model, refs))  # experts: the global tensor's shape
    _agree_or_raise(_check_full_sd(sd, shapes, strict) if is_source else None, state)
    first_key: dict[int, str] = {}  # tied parameters: the first of their names is the source
    for key, value in refs.items():
        if is_fragment(value):
            first_key.setdefault(id(value), key)
    for unit in state.units:
        for group in unit.groups:
            if has_own_mesh(unit):
                load_placed_group(model, group, sd, first_key, state)
            else:
                _load_group(group, sd, first_key, is_source, state)
    for key, value in refs.items():
        if torch.is_tensor(value) and not is_fragment(value):
            source = sd[key].to(value.device, value.dtype) if is_source else value.detach()
            buf = source.contiguous().clone()
            _to_tp_peers(buf, state)
            _from_mesh_first(buf, state)
            value.copy_(buf)


def _from_mesh_first(tensor: torch.Tensor, state: ShardedState) -> None:
    """The mesh's first rank's ``tensor`` on every rank of the model's mesh."""
    broadcast(tensor, 0, state.topology.mesh_group, state.stats)  # no-op on a mesh of one


def _to_tp_peers(tensor: torch.Tensor, state: ShardedState) -> None:
    """With TP: the model's first rank's ``tensor`` on its tp peers (the other first ranks
    of their dp meshes), before each broadcasts over its own dp mesh."""
    if state.tp is not None and state.topology.is_mesh_first:
        broadcast(tensor, 0, state.tp.group, state.stats)


def _load_group(group, sd: dict, first_key: dict, is_source: bool, state: ShardedState) -> None:
    full = torch.zeros(group.padded_numel, dtype=group.dtype, device=group.device)
    on_tp_peers = state.tp is not None and state.topology.is_mesh_first
    for spec, tp in zip(group.specs, group.tp, strict=True):
        if not (is_source or on_tp_peers):
            break
        shape = spec.shape if tp is None else tp.shape
        src = sd[first_key[id(spec.fragment)]] if is_source else None
        src = src.to(group.device, group.dtype) if src is not None else None
        if on_tp_peers:  # the whole parameter on every tp peer, then each keeps its part
            src = src.contiguous() if src is not None else torch.empty(shape, dtype=group.dtype)
            _to_tp_peers(src, state)
            src = local_part(src, tp)
        full[spec.offset : spec.offset + spec.numel].copy_(src.reshape(-1))
    _from_mesh_first(full, state)
    lo = group.rank * group.shard_numel
    group.shard.copy_(full[lo : lo + group.shard_numel])


def _check_full_sd(sd: dict, shapes: dict, strict: bool) -> str | None:
    missing = [k for k in shapes if k not in sd]
    unexpected = [k for k in sd if k not in shapes]
    if strict and (missing or unexpected):
        return (
            f"state dict keys do not match the model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}; pass the full_state_dict of the same architecture "
            "(or strict=False to load what matches)"
        )
    if missing:
        return f"state dict lacks {missing[:5]}, which flatshard needs to fill every shard"
    for key, shape in shapes.items():
        if tuple(sd[key].shape) != tuple(shape):
            return (
                f"state dict entry {key!r} has shape {tuple(sd[key].shape)}, the model's is "
                f"{tuple(shape)}; load a state dict of the same architecture"
            )
    return None


def _agree_or_raise(error: str | None, state: ShardedState) -> None:
    box = [error]
    group = state.topology.mesh_group if state.tp is None else state.tp.model_group
    if dist.get_world_size(group) > 1:
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    if box[0] is not None:
        rank = dist.get_rank()  # world: the global rank names this process in messages
        raise ValueError(f"[flatshard rank {rank}] {box[0]}")


@contextmanager
def summon_full_params(
    model: nn.Module, *legacy_flags: bool, writeback: bool = True, rank0_only: bool = False
) -> Iterator[nn.Module]:
    """Inside the block every parameter of ``model`` is its full tensor; with ``writeback``
    the edits made to them are written back to the shards on exit. Every rank must enter;
    inside, forward runs on the full parameters without any collective (so one rank alone may
    run it, e.g. to generate), and no gradient reaches the shards.

    ``rank0_only``: only the mesh's first rank holds the full parameters (the others gather unit by
    unit and let go, keeping their fragments); on exit rank 0's edits are broadcast back.
    Both flags are keyword-only (positional ones still work, with a ``DeprecationWarning``).
    """
    if legacy_flags:
        if len(legacy_flags) > 2:
            raise TypeError("summon_full_params(model, *, writeback=..., rank0_only=...)")
        warnings.warn(
            "summon_full_params(model, writeback, rank0_only) with positional flags is "
            "deprecated: pass writeback=... and rank0_only=... by name",
            DeprecationWarning,
            stacklevel=3,  # the caller of the context manager's __enter__
        )
        writeback, rank0_only = (*legacy_flags, rank0_only)[:2]
    state = get_state(model)
    if state.mode is StateMode.SUMMONED:
        raise ValueError("summon_full_params is already active for this model; do not nest it")
    if any(u.float8_groups for u in state.units):  # see [Note: float8 all-gather]
        raise NotImplementedError(
            "summon_full_params does not support torchao's float8 all-gather weights (they are "
            "gathered in float8); read the full weights with fs.full_state_dict(model)"
        )
    wire = state.stats.gather_wire  # see [Note: quantized weight gather]
    if any(quantized_gather.applies(g, wire) for u in state.units for g in u.groups):
        raise NotImplementedError(
            f"summon_full_params does not support fs.Comm(gather={wire!r}) "
            "(its full weights are dequantized approximations, and the write-back would store "
            "them in the masters); read the full weights with fs.full_state_dict(model)"
        )
    holds_full = not rank0_only or state.topology.is_mesh_first
    with torch.no_grad():
        for unit in state.units:
            state.ensure_gathered(unit)
            if holds_full:
                unit.install_views(unit.as_parameters([g.full_views() for g in unit.groups]))
            else:
                unit.reshard(state.timeout)
    previous, state.mode = state.mode, StateMode.SUMMONED
    try:
        yield model
    finally:
        state.mode = previous
        with torch.no_grad():
            for unit in state.units:
                unit.install_fragments()
                if writeback:
                    _write_back(unit, state, from_rank0=rank0_only)
            state.reshard_all()


def _write_back(unit: Unit, state: ShardedState, *, from_rank0: bool) -> None:
    """Copy this rank's slice of the (edited) full buffers into its shards."""
    for g in unit.groups:
        full = g.full.data
        if from_rank0:
            if not state.topology.is_mesh_first:
                full = torch.empty(g.padded_numel, dtype=g.dtype, device=g.device)
            _from_mesh_first(full, state)
        lo = g.rank * g.shard_numel
        g.shard.copy_(full[lo : lo + g.shard_numel])
