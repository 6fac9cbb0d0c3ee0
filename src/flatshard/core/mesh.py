"""Resolving ``strategy`` + ``mesh=`` into a ``Topology``: who shards with whom, who replicates.

Each strategy names the role of each mesh dimension (core/strategy.py ``STRATEGIES``):

    full_shard / shard_grad_op   shard over the mesh (1-D), no replication
    no_shard                     no sharding (every rank holds everything), replicate over the mesh
    hybrid_shard                 2-D mesh (replicate, shard): shard within a row, replicate across

A group of size one is represented by ``None``: no collective is ever issued on it.

[Note: a model talks only to its own ranks]
Every collective of a sharded model -- gathers, reductions, agreement checks, state-dict
broadcasts, checkpoint plans -- runs on a group of the mesh it was sharded over, never on the
default (world) group: the day the model is one stage of a pipeline or one of several models of
a job, the other ranks are busy elsewhere and a world collective hangs. ``Topology.mesh_group``
spans every rank of the mesh (the shard group, the replicate group, or for a 2-D mesh a group
over both); "rank 0" of the model-level helpers (``fs.full_state_dict``'s holder,
``fs.load_full_state_dict``'s source) is the mesh's first rank: rank 0 of ``mesh_group``, the
lowest global rank of the mesh.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from flatshard.comm.collectives import waits_on_host
from flatshard.core.strategy import STRATEGIES, MeshRole, ShardingStrategy
from flatshard.core.streams import NO_STREAMS, Streams, streams_for


@dataclass(frozen=True)
class Topology:
    shard_group: dist.ProcessGroup | None  # parameters are split over it (None: not split)
    replicate_group: dist.ProcessGroup | None  # gradients are averaged over it after the split
    shard_rank: int
    shard_world: int
    device: torch.device
    # Every rank of the mesh, even when that is this rank alone (a real group, never None:
    # DCP given no group would fall back to the default group).
    mesh_group: dist.ProcessGroup
    # ``groups`` on Gloo (the usage agreement's host path); empty on a device backend, which
    # agrees on the device (core/usage.py) and makes no Gloo side group.
    host_groups: tuple[dist.ProcessGroup, ...] = ()
    # Every stream operation of the model, and the side streams gathers and reductions are
    # issued from (core/streams.py): CUDA's, a process group's virtual ones, or none.
    streams: Streams = NO_STREAMS
    # A unit on its own mesh averages its gradients over the model's data-parallel world, not
    # over its mesh (see [Note: per-unit meshes] in unit_mesh.py); None: over its mesh.
    divide_by: int | None = None
    # The process groups made for this model (see MadeGroups): they live and die with it.
    made: MadeGroups = field(default_factory=lambda: MadeGroups(), compare=False, repr=False)

    @property
    def is_mesh_first(self) -> bool:
        """Is this process the mesh's first rank (its lowest global rank)?"""
        return dist.get_rank(self.mesh_group) == 0

    @property
    def mesh_size(self) -> int:
        return dist.get_world_size(self.mesh_group)

    @property
    def groups(self) -> list[dist.ProcessGroup]:
        """Every group a data-parallel reduction must cover (shard, then replicate)."""
        return [g for g in (self.shard_group, self.replicate_group) if g is not None]


def require_initialized() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "fs.shard needs torch.distributed to be initialised: call "
            "torch.distributed.init_process_group('gloo' or 'nccl') first, or launch with torchrun"
        )


def resolve_topology(strategy: ShardingStrategy, mesh, made: MadeGroups | None = None) -> Topology:
    """``mesh`` read the way ``strategy`` reads it (see core/strategy.py); the groups it has
    to make go into ``made`` (default: new, the model's own)."""
    made = MadeGroups() if made is None else made
    roles = STRATEGIES[strategy].dims
    dims = _mesh_groups(mesh, strategy, len(roles))
    shard = next((g for r, g in zip(roles, dims, strict=True) if r is MeshRole.SHARD), None)
    replicate = next((g for r, g in zip(roles, dims, strict=True) if r is MeshRole.REPLICATE), None)
    whole = dims[0] if len(dims) == 1 else _whole_mesh_group(mesh, made)
    device = compute_device(whole)  # asked before size-one groups become None
    shard = shard if shard is not None and dist.get_world_size(shard) > 1 else None
    replicate = replicate if replicate is not None and dist.get_world_size(replicate) > 1 else None
    return Topology(
        shard_group=shard,
        replicate_group=replicate,
        shard_rank=dist.get_rank(shard) if shard is not None else 0,
        shard_world=dist.get_world_size(shard) if shard is not None else 1,
        device=device,
        mesh_group=whole,
        host_groups=_host_groups(shard, replicate, whole, made),
        streams=streams_for(device, whole),
    )


def _host_groups(shard, replicate, whole, made: MadeGroups) -> tuple[dist.ProcessGroup, ...]:
    """The groups the host path of the usage agreement reduces over: on Gloo only (they are
    the groups themselves). A device backend agrees on the device, over ``whole`` (see
    [Note: how usage is agreed] in core/usage.py), so it makes no Gloo side group: a job on
    NCCL needs no Gloo networking between its nodes."""
    if not waits_on_host(whole):
        return ()
    return tuple(_host_group(g, made) for g in (shard, replicate) if g is not None)


def _host_group(group: dist.ProcessGroup, made: MadeGroups) -> dist.ProcessGroup:
    """A group over ``group``'s ranks that reduces CPU tensors: itself when its backend has
    Gloo (``gloo``, ``cpu:gloo,cuda:nccl``), else a Gloo group made by those ranks alone
    (kept in ``made``, like the 2-D mesh groups)."""
    if "gloo" in str(dist.get_backend(group)):
        return group
    return members_group(tuple(dist.get_process_group_ranks(group)), "gloo", made)


def _mesh_groups(mesh, strategy: ShardingStrategy, ndim: int) -> list[dist.ProcessGroup]:
    """The group of each dimension of ``mesh`` (``ndim`` of them, as the strategy needs)."""
    return [_one_group(mesh, strategy)] if ndim == 1 else _two_groups(mesh, strategy)


def _whole_mesh_group(mesh, made: MadeGroups) -> dist.ProcessGroup:
    """One group over every rank of a 2-D mesh: the default group when the mesh spans it,
    otherwise a group of the mesh's ranks (made once per rank set and kept in ``made``; only
    the mesh's ranks take part in making it, so a mesh that is one slice of a bigger job
    never waits on the others)."""
    ranks = tuple(sorted(int(r) for r in mesh.mesh.flatten().tolist()))
    if len(ranks) == dist.get_world_size():  # world: does the mesh span every rank?
        return dist.group.WORLD  # world: the mesh spans every rank, so its group is the world
    return members_group(ranks, str(dist.get_backend(mesh.get_group(0))), made)


def members_group(ranks: tuple[int, ...], backend: str, made: MadeGroups) -> dist.ProcessGroup:
    """A ``backend`` group over ``ranks`` that only those ranks take part in making, made
    once per (ranks, backend) and kept in ``made`` (the model's, ``Topology.made``)."""
    # A set of every rank on the default backend is the default group; a new group made with
    # local synchronization over it hung once the job had made hashed-name groups before.
    world = len(ranks) == dist.get_world_size()  # world: do the ranks span every rank?
    if world and backend == str(dist.get_backend()):
        return dist.group.WORLD  # world: the ranks are every rank, so their group is the world
    return made.get(ranks, backend)


class MadeGroups:
    """The process groups flatshard made for one model, by (ranks, backend), kept on its
    ``Topology`` (no process-wide cache: a model's groups are found from the model, and a
    new ``init_process_group`` cannot meet a stale one).

    Making a group is a collective of its ranks, so every rank of it must ask for the same
    groups in the same order: they do, as they run the same ``fs.shard`` (and ``fs.save``)
    calls. Sharding two models over one mesh slice makes two groups; torch keeps every
    group it made until ``destroy_process_group``."""

    def __init__(self) -> None:
        self._groups: dict[tuple[tuple[int, ...], str], dist.ProcessGroup] = {}

    def get(self, ranks: tuple[int, ...], backend: str) -> dist.ProcessGroup:
        """The ``backend`` group over ``ranks``, made at the first request."""
        key = (ranks, backend)
        if key not in self._groups:
            self._groups[key] = dist.new_group(
                list(ranks), backend=backend, use_local_synchronization=True
            )
        return self._groups[key]


def _one_group(mesh, strategy: ShardingStrategy) -> dist.ProcessGroup:
    """The group of a 1-D layout: the world, a 1-D DeviceMesh or a ProcessGroup."""
    if mesh is None:
        return dist.group.WORLD  # world: mesh=None means all ranks, by the public contract
    if isinstance(mesh, dist.ProcessGroup):
        return mesh
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            raise ValueError(
                f"mesh={mesh!r} has {mesh.ndim} dimensions; strategy {strategy.value!r} uses a 1-D "
                "mesh. Pass mesh[dim_name] for one dimension, or strategy='hybrid_shard' for a "
                "2-D (replicate, shard) mesh"
            )
        return mesh.get_group()
    raise TypeError(
        f"mesh={mesh!r} is a {type(mesh).__name__}; pass None (all ranks), a "
        "torch.distributed.device_mesh.DeviceMesh, or a ProcessGroup"
    )


def _two_groups(mesh, strategy: ShardingStrategy) -> list[dist.ProcessGroup]:
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2:
        raise ValueError(
            f"strategy={strategy.value!r} needs mesh= a 2-D DeviceMesh with dims (replicate, "
            f"shard), got {mesh!r}; e.g. init_device_mesh('cuda', (nodes, gpus_per_node), "
            "mesh_dim_names=('replicate', 'shard'))"
        )
    return [mesh.get_group(0), mesh.get_group(1)]


def compute_device(group: dist.ProcessGroup) -> torch.device:
    """CUDA (this process's current device) when the group talks NCCL, else CPU."""
    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower() and torch.cuda.is_available():
        current = torch.cuda.current_device()
        check_cuda_device(current, os.environ.get("LOCAL_RANK"), torch.cuda.device_count())
        return torch.device("cuda", current)
    return torch.device("cpu")


def check_cuda_device(current: int, local_rank: str | None, device_count: int) -> None:
    """The current CUDA device must be this process's own: torchrun starts every process on
    device 0, and NCCL then fails later with "Duplicate GPU detected" (or, worse, all ranks of
    a node share one GPU). ``ValueError`` naming the fix when it is not."""
    if local_rank is None or device_count <= 1:
        return
    expected = int(local_rank) % device_count
    if current != expected:
        raise ValueError(
            f"fs.shard: the current CUDA device is cuda:{current}, but this process is "
            f"LOCAL_RANK={local_rank} of a machine with {device_count} GPUs (expected "
            f"cuda:{expected}); call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) "
            "before init_process_group and fs.shard"
        )
