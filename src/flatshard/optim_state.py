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
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from .comm.collectives import all_gather_into, broadcast
from .engine.compile_boundary import plain_name
from .engine.state import get_state
from .engine.tensor_parallel import refuse_tp
from .engine.unit_mesh import refuse_unit_meshes

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
    optimizer: torch.optim.Optimizer, group, process_group
) -> tuple[list[str], set[int]]:
    """State keys shaped like the fragments of ``group``, and the indices of the parameters
    that have any state: each the union over the shard group (a parameter the optimizer never
    stepped has no state anywhere, and must get none: it shares the group's buffers only)."""
    keys, stepped = set(), set()
    for index, spec in enumerate(group.specs):
        state = optimizer.state.get(spec.fragment, {})
        stepped.update([index] if state else [])
        keys.update(k for k, v in state.items() if _is_fragment_shaped(v, spec.fragment))
    if process_group is not None:
        every: list[tuple | None] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(every, (sorted(keys), sorted(stepped)), group=process_group)
        keys = set().union(*[set(k) for k, _ in every])
        stepped = set().union(*[set(s) for _, s in every])
    return sorted(keys), stepped


def _groups(model: nn.Module) -> Iterator[tuple[object, object]]:
    for unit in get_state(model).units:
        for group in unit.groups:
            yield unit, group


@torch.no_grad()
def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Rank 0: ``optimizer``'s full state keyed by parameter name; other ranks ``{}``.
    Every rank must call it (it gathers)."""
    refuse_tp(get_state(model), "fs.full_optimizer_state_dict")
    refuse_unit_meshes(get_state(model), "fs.full_optimizer_state_dict")
    names, timeout = _names(model), get_state(model).timeout
    out: dict[str, dict] = {}
    for unit, group in _groups(model):
        keys, stepped = _fragment_keys(optimizer, group, unit.process_group)
        for key in keys:
            full = _gather(optimizer, group, key, unit, timeout)
            for index, spec in enumerate(group.specs):
                if index not in stepped:
                    continue
                view = full[spec.offset : spec.offset + spec.numel].view(spec.shape)
                out.setdefault(names[id(spec.fragment)], {})[key] = view.to("cpu", copy=True)
    if not get_state(model).topology.is_mesh_first:
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
    refuse_tp(get_state(model), "fs.load_full_optimizer_state_dict")
    refuse_unit_meshes(get_state(model), "fs.load_full_optimizer_state_dict")
    mesh = get_state(model).topology
    is_rank0 = mesh.is_mesh_first
    saved = osd.get("state", {}) if is_rank0 else {}
    groups = _from_mesh_first(osd.get("param_groups") if is_rank0 else None, mesh.mesh_group)
    _set_hyperparameters(optimizer, groups)
    for unit, group in _groups(model):
        keys, others = _from_mesh_first(
            _plan(saved, group, names) if is_rank0 else None, mesh.mesh_group
        )
        for key, dtype in keys:
            full = _full_buffer(saved, group, key, names, dtype, unit) if is_rank0 else None
            full = _broadcast_full(full, group, dtype, unit, mesh.mesh_group)
            start = group.layout.shard_start
            for spec in group.specs:
                if spec.fragment.requires_grad:
                    piece = full[start + spec.local_start : start + spec.local_end]
                    entry = optimizer.state.setdefault(spec.fragment, {})
                    entry[key] = piece.to(spec.fragment.device, copy=True)  # where state lives
        for spec in group.specs:
            for key, value in others.get(names[id(spec.fragment)], {}).items():
                optimizer.state.setdefault(spec.fragment, {})[key] = value


def _from_mesh_first(value, mesh_group: dist.ProcessGroup):
    """The mesh's first rank's ``value`` (a picklable object) on every rank of the mesh."""
    if dist.get_world_size(mesh_group) == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(mesh_group, 0), group=mesh_group)
    return box[0]


def _plan(saved: dict, group, names: dict[int, str]) -> tuple[list, dict]:
    """Rank 0: the fragment-shaped keys of ``group`` (with dtypes) and the other entries."""
    keys: dict[str, torch.dtype] = {}
    others: dict[str, dict] = {}
    for spec in group.specs:
        name = names[id(spec.fragment)]
        for key, value in saved.get(name, {}).items():
            if torch.is_tensor(value) and value.shape == spec.shape and value.dim():
                keys.setdefault(key, value.dtype)
            else:
                others.setdefault(name, {})[key] = value
    return sorted(keys.items()), others


def _full_buffer(saved, group, key, names, dtype, unit) -> torch.Tensor:
    world = dist.get_world_size(unit.process_group) if unit.process_group is not None else 1
    full = torch.zeros(world * group.shard_numel, dtype=dtype)
    for spec in group.specs:
        value = saved.get(names[id(spec.fragment)], {}).get(key)
        if value is not None:
            full[spec.offset : spec.offset + spec.numel].copy_(value.reshape(-1))
    return full


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
