"""Full (unsharded) optimizer state, torch's FQN-keyed layout, for one-file checkpoints.

``full_optimizer_state_dict`` returns what ``torch.distributed.checkpoint.state_dict.
get_optimizer_state_dict(..., full_state_dict=True)`` gives for an unsharded model: on rank 0
``{"state": {name: {key: full tensor}}, "param_groups": [{..., "params": [names]}]}`` ("rank
0" is the mesh's first rank: every collective here runs on the model's own mesh). A state
tensor shaped like its fragment (``exp_avg``, ``momentum_buffer``) is gathered the way the
parameters are: one all-gather per (flat group, key) into a buffer laid out like the gathered
parameters. Any other state (AdamW's ``step``) is the same on every rank and taken as it is.
``load_full_optimizer_state_dict`` is the inverse: rank 0's full tensors are broadcast one flat
group and key at a time, each rank keeps its fragments' ranges. Peak: one group's full buffer.

With tensor parallelism the layout is ``fs.full_state_dict``'s: a state tensor of a TP
parameter is its *global* tensor (gathered over tp with ``full_tensor``), held by the first dp
rank of every tp column; loading takes the model's first rank's global tensors, sends them to
its tp peers, each cuts its TP-local block (``local_part``) and broadcasts over its dp mesh.
Saved and loaded tensors are therefore the same whatever the (dp, tp) layout: a state saved
with TP loads without it and the other way round. State that is not fragment-shaped (AdamW's
``step``; Adafactor's factors, which are the global matrix's on every rank) is taken as it is.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from flatshard.comm.collectives import all_gather_into, broadcast
from flatshard.core.state import ShardedState, get_state
from flatshard.features.compile_boundary import plain_name
from flatshard.parallel.tensor import full_tensor, local_part
from flatshard.parallel.unit_mesh import refuse_unit_meshes

__all__ = ["full_optimizer_state_dict", "load_full_optimizer_state_dict"]


def _names(model: nn.Module) -> dict[int, str]:
    """Each parameter's name as the plain model has it (no ``_orig_mod.`` of a compiled
    block: the keys of a full optimizer state are checkpoint keys)."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), plain_name(name))
    return names


def _is_fragment_shaped(value: object, fragment: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.dim() == 1 and value.shape == fragment.shape


def _fragment_keys(
    optimizer: torch.optim.Optimizer, group, process_groups: list
) -> tuple[list[str], set[tuple[int, str]]]:
    """State keys shaped like the fragments of ``group``, and which parameter (its index)
    has which of them: each the union over the shard group, then (with TP) over the tp
    peers, who gather the TP parameters' state together. A parameter gets only its own keys
    (Adafactor keeps ``variance`` for vectors, factors for matrices; one never stepped has
    none): the others would be zeros read from the group's buffer."""
    keys, has = set(), set()
    for index, spec in enumerate(group.specs):
        for key, value in optimizer.state.get(spec.fragment, {}).items():
            if _is_fragment_shaped(value, spec.fragment):
                keys.add(key)
                has.add((index, key))
    for process_group in process_groups:
        if process_group is None:
            continue
        every: list[tuple | None] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(every, (sorted(keys), sorted(has)), group=process_group)
        keys = set().union(*[set(k) for k, _ in every])
        has = set().union(*[{tuple(h) for h in hs} for _, hs in every])
    return sorted(keys), has


def _groups(model: nn.Module) -> Iterator[tuple[object, object]]:
    for unit in get_state(model).units:
        for group in unit.groups:
            yield unit, group


@torch.no_grad()
def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Rank 0: ``optimizer``'s full state keyed by parameter name; other ranks ``{}``
    (with TP: the first dp rank of every tp column holds it, global tensors, as
    ``fs.full_state_dict``). Every rank must call it (it gathers)."""
    state = get_state(model)
    refuse_unit_meshes(state, "fs.full_optimizer_state_dict")
    names, timeout, holds = _names(model), state.timeout, state.topology.is_mesh_first
    tp_group = state.tp.group if state.tp is not None else None
    out: dict[str, dict] = {}
    for unit, group in _groups(model):
        keys, has = _fragment_keys(optimizer, group, [unit.process_group, tp_group])
        for key in keys:
            full = _gather(optimizer, group, key, unit, timeout)
            for index, spec in enumerate(group.specs):
                if (index, key) not in has or not holds:
                    continue
                view = full[spec.offset : spec.offset + spec.numel].view(spec.shape)
                whole = full_tensor(view, group.tp[index])  # tp peers (all holders) gather
                out.setdefault(names[id(spec.fragment)], {})[key] = whole.to("cpu", copy=True)
    if not holds:
        return {}
    for param, values in optimizer.state.items():
        name = names.get(id(param))
        for key, value in values.items():
            if name is not None and key not in out.get(name, {}):
                copy = value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value
                out.setdefault(name, {})[key] = copy
    groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [names[id(p)] for p in g["params"]],
        }
        for g in optimizer.param_groups
    ]
    return {"state": out, "param_groups": groups}


def _gather(optimizer, group, key: str, unit, timeout) -> torch.Tensor:
    values = [optimizer.state.get(s.fragment, {}).get(key) for s in group.specs]
    dtype = next((v.dtype for v in values if v is not None), torch.float32)
    # Collectives on the compute device (``group.device``): under CPUOffload the state lives
    # on the host, and NCCL gathers device tensors only.
    shard = torch.zeros(group.shard_numel, dtype=dtype, device=group.device)
    for spec, value in zip(group.specs, values, strict=True):
        if value is not None and spec.local_end > spec.local_start:
            shard[spec.local_start : spec.local_end].copy_(value)
    world = dist.get_world_size(unit.process_group) if unit.process_group is not None else 1
    full = torch.empty(world * group.shard_numel, dtype=dtype, device=shard.device)
    all_gather_into(full, shard, unit.process_group, unit.stats, "optimizer_state").wait(timeout)
    return full


@torch.no_grad()
def load_full_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, osd: dict
) -> None:
    """Load ``full_optimizer_state_dict``'s result (held by rank 0; other ranks may pass ``{}``)
    into ``optimizer``'s fragments, and rank 0's hyperparameters into its param groups. Every
    rank must call it; the optimizer must have the saving one's param groups."""
    names = _names(model)
    state = get_state(model)
    refuse_unit_meshes(state, "fs.load_full_optimizer_state_dict")
    mesh = state.topology
    # With TP the source is the model's first rank; its tp peers (the other dp meshes'
    # first ranks) get each global tensor from it, then broadcast over their own dp mesh.
    everyone = mesh.mesh_group if state.tp is None else state.tp.model_group
    is_source = mesh.is_mesh_first and (state.tp is None or state.tp.is_tp_first)
    saved = osd.get("state", {}) if is_source else {}
    groups = _from_mesh_first(osd.get("param_groups") if is_source else None, everyone)
    _set_hyperparameters(optimizer, groups)
    for unit, group in _groups(model):
        keys, others = _from_mesh_first(_plan(saved, group, names) if is_source else None, everyone)
        for key, dtype, holders in keys:
            pairs = zip(group.specs, group.tp, strict=True)
            specs = [(s, tp) for s, tp in pairs if names[id(s.fragment)] in holders]
            full = None
            if mesh.is_mesh_first:
                full = _full_buffer(saved, group, key, (names, specs), dtype, unit, state)
            full = _broadcast_full(full, group, dtype, unit, mesh.mesh_group)
            start = group.layout.shard_start
            for spec, _ in specs:
                if spec.fragment.requires_grad:
                    piece = full[start + spec.local_start : start + spec.local_end]
                    entry = optimizer.state.setdefault(spec.fragment, {})
                    entry[key] = piece.to(spec.fragment.device, copy=True)  # where state lives
        for spec in group.specs:
            for key, value in others.get(names[id(spec.fragment)], {}).items():
                optimizer.state.setdefault(spec.fragment, {})[key] = value


def _from_mesh_first(value, mesh_group: dist.ProcessGroup):
    """The first rank's ``value`` (a picklable object) on every rank of ``mesh_group``."""
    if dist.get_world_size(mesh_group) == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(mesh_group, 0), group=mesh_group)
    return box[0]


def _plan(saved: dict, group, names: dict[int, str]) -> tuple[list, dict]:
    """Rank 0: the fragment-shaped keys of ``group`` (with their dtype and the names of the
    parameters that have them) and the other entries."""
    keys: dict[str, tuple[torch.dtype, list[str]]] = {}
    others: dict[str, dict] = {}
    for spec, tp in zip(group.specs, group.tp, strict=True):
        name = names[id(spec.fragment)]
        shape = spec.shape if tp is None else tp.shape  # saved state is global
        for key, value in saved.get(name, {}).items():
            if torch.is_tensor(value) and value.shape == shape and value.dim():
                keys.setdefault(key, (value.dtype, []))[1].append(name)
            else:
                others.setdefault(name, {})[key] = value
    return [(key, dtype, holders) for key, (dtype, holders) in sorted(keys.items())], others


def _full_buffer(saved, group, key, where: tuple, dtype, unit, state: ShardedState):
    """A dp mesh's first rank: ``key``'s flat-group buffer (TP-local blocks with TP), from
    the source's ``saved``, for the parameters of ``where`` = (names, [(spec, tp)]) that
    have ``key`` (zeros elsewhere)."""
    names, specs = where
    world = dist.get_world_size(unit.process_group) if unit.process_group is not None else 1
    full = torch.zeros(world * group.shard_numel, dtype=dtype)
    for spec, tp in specs:
        value = saved.get(names[id(spec.fragment)], {}).get(key)
        if state.tp is not None:  # the global tensor from the source to its tp peers
            value = _from_tp_first(value, spec.shape if tp is None else tp.shape, dtype, state)
            value = local_part(value, tp)
        if value is not None:
            full[spec.offset : spec.offset + spec.numel].copy_(value.reshape(-1))
    return full


def _from_tp_first(value, shape, dtype, state: ShardedState) -> torch.Tensor:
    """The tp-first rank's ``value`` (global ``shape``; zeros where it is None) on its tp
    peers, on the compute device for the collective (NCCL broadcasts device tensors)."""
    if state.tp.is_tp_first and value is not None:
        tensor = value.to(state.device, dtype).contiguous().clone()
    else:
        tensor = torch.zeros(shape, dtype=dtype, device=state.device)
    broadcast(tensor, 0, state.tp.group, state.stats)
    return tensor.cpu()


def _broadcast_full(full, group, dtype, unit, mesh_group) -> torch.Tensor:
    """The first rank's full buffer on every rank, on the compute device (see ``_gather``)."""
    world = dist.get_world_size(unit.process_group) if unit.process_group is not None else 1
    device = group.device
    if full is None:
        full = torch.empty(world * group.shard_numel, dtype=dtype, device=device)
    else:
        full = full.to(device)
    broadcast(full, 0, mesh_group, unit.stats)  # no-op on a mesh of one
    return full


def _set_hyperparameters(optimizer: torch.optim.Optimizer, groups: list[dict] | None) -> None:
    if groups is None:
        return
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the saved optimizer has {len(groups)} param groups, this one "
            f"{len(optimizer.param_groups)}; build it with the same groups as the saving one"
        )
    for mine, theirs in zip(optimizer.param_groups, groups, strict=True):
        mine.update({k: v for k, v in theirs.items() if k != "params"})
