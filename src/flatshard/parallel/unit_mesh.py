"""Units sharded over their own mesh: a policy that returns a DeviceMesh for a module.

[Note: per-unit meshes]
A model is sharded over its mesh (``fs.shard(..., mesh=)``: the data-parallel ranks). A policy
may return a ``DeviceMesh`` (or ``ProcessGroup``) instead of ``True`` for a module: that unit's
parameters are sharded over that mesh. The use is expert parallelism (torchtitan's layout):
each expert-parallel rank holds other experts, and an expert's parameters are sharded over
the ranks that hold the same experts (the expert-data-parallel mesh, ``dp / ep`` of them),
while the dense layers are sharded over all of dp.

* **Averaging.** A rank's loss is the mean over its own tokens, the model's objective the mean
  over the dp ranks. Tokens of every rank reach an expert through the all-to-all, so the sum
  over the expert-data-parallel ranks of an expert's gradient already holds every dp rank's
  contribution: it must be divided by the *model's* data-parallel world, not by the size of the
  unit's mesh (the trap torchtitan fell into, PR #1551). ``Topology.divide_by`` says so.
* **Ranks.** The unit's mesh must consist of ranks of the model's mesh and its size must divide
  the model's data-parallel world (``ValueError`` otherwise, at ``fs.shard``).
* **Everything else** runs per unit as usual (gathers, reductions, prefetch); such units never
  join a bucket (their collectives run on another group). The used-parameter agreement still
  runs over the model's ranks (stacked experts are always "used").
* **Where a rank-local tensor sits.** A unit on its own mesh holds rank-local tensors under the
  whole model's names (ep rank ``j``'s experts ``j*E_l ..``). Checkpoints need their place in
  the global tensor: the module owning such parameters says it with a method
  ``flatshard_placement(self) -> {name: (dim, offset, size)}`` (this rank's tensor is the
  slice ``[offset, offset + local size)`` along ``dim`` of a global tensor whose ``dim`` has
  ``size`` elements; ``flatshard.models.moe.Experts`` has one). ``fs.save``/``fs.load`` then
  write and read the global tensors' chunks (an origin, as tensor-parallel blocks have), so an
  expert-parallel checkpoint loads at another EP degree or without EP; full state dicts and
  safetensors exports assemble the global tensors (parallel/placed_state.py). ``fs.save_pretrained``
  and full optimizer state dicts still refuse such models (``refuse_unit_meshes``).
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from flatshard.core.mesh import Topology, resolve_topology
from flatshard.core.options import ShardOptions
from flatshard.core.reduce import data_parallel_world


def unit_topology(mesh, model_topology: Topology, options: ShardOptions, where: str) -> Topology:
    """The topology of a unit the policy gave ``mesh`` (``where`` names the module)."""
    topology = resolve_topology(options.strategy, mesh, model_topology.made)
    ranks = set(dist.get_process_group_ranks(topology.mesh_group))
    model_ranks = set(dist.get_process_group_ranks(model_topology.mesh_group))
    world = data_parallel_world(model_topology)
    if not ranks <= model_ranks:
        raise ValueError(
            f"fs.shard: the policy gave {where} a mesh over ranks {sorted(ranks)}, which are not "
            f"all ranks of the model's mesh ({sorted(model_ranks)}); return a sub-mesh of the "
            "mesh you shard the model over (e.g. the expert-data-parallel dim of the same "
            "DeviceMesh)"
        )
    if world % data_parallel_world(topology):
        raise ValueError(
            f"fs.shard: the policy gave {where} a mesh of {data_parallel_world(topology)} ranks, "
            f"which does not divide the model's {world} data-parallel ranks; use a sub-mesh "
            "whose size divides it"
        )
    return dataclasses.replace(topology, divide_by=world)


def refuse_unit_meshes(state, what: str) -> None:
    """``NotImplementedError`` for ``what`` on a model with per-unit meshes (see the Note)."""
    if any(u.topology.divide_by is not None for u in state.units):
        raise NotImplementedError(
            f"{what} does not support units sharded over their own mesh (a policy that returned "
            "a DeviceMesh, e.g. experts) yet: their parameters differ between expert-parallel "
            "ranks; read them inside fs.summon_full_params on each rank instead"
        )


def placement(model, name: str, tag) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(global shape, origin) of parameter ``name`` of ``model`` if its unit has its own mesh
    (see the Note), else ``None``; ``NotImplementedError`` if its module does not say."""
    state = tag.state()
    if state.units[tag.unit].topology.divide_by is None:
        return None
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    said = getattr(owner, "flatshard_placement", None)
    spec = said().get(attr) if callable(said) else None
    if spec is None:
        raise NotImplementedError(
            f"{name!r} belongs to a unit sharded over its own mesh, and its module "
            f"{type(owner).__name__} does not say where this rank's tensor sits in the global "
            "one: give it a method flatshard_placement() -> {name: (dim, offset, size)} "
            "(see flatshard.models.moe.Experts) to checkpoint it"
        )
    dim, offset, size = spec
    local = tuple(tag.full_shape)
    if not 0 <= offset <= offset + local[dim] <= size:
        raise ValueError(
            f"{type(owner).__name__}.flatshard_placement() puts {name!r} (size {local[dim]} "
            f"along dim {dim}) at offset {offset} of {size}; it must fit inside"
        )
    shape = (*local[:dim], size, *local[dim + 1 :])
    origin = tuple(offset if d == dim else 0 for d in range(len(local)))
    return shape, origin
