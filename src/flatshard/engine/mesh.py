"""Resolving ``strategy`` + ``mesh=`` into a ``Topology``: who shards with whom, who replicates.

    full_shard / shard_grad_op   shard over the mesh (1-D), no replication
    no_shard                     no sharding (every rank holds everything), replicate over the mesh
    hybrid_shard                 2-D mesh (replicate, shard): shard within a row, replicate across

A group of size one is represented by ``None``: no collective is ever issued on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    shard_group: dist.ProcessGroup | None  # parameters are split over it (None: not split)
    replicate_group: dist.ProcessGroup | None  # gradients are averaged over it after the split
    shard_rank: int
    shard_world: int
    device: torch.device

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


def resolve_topology(strategy: str, mesh) -> Topology:
    if strategy == "hybrid_shard":
        replicate, shard = _two_groups(mesh)
    else:
        group = _one_group(mesh, strategy)
        replicate, shard = (group, None) if strategy == "no_shard" else (None, group)
    shard = shard if shard is not None and dist.get_world_size(shard) > 1 else None
    replicate = replicate if replicate is not None and dist.get_world_size(replicate) > 1 else None
    return Topology(
        shard_group=shard,
        replicate_group=replicate,
        shard_rank=dist.get_rank(shard) if shard is not None else 0,
        shard_world=dist.get_world_size(shard) if shard is not None else 1,
        device=compute_device(dist.group.WORLD),
    )


def _one_group(mesh, strategy: str) -> dist.ProcessGroup:
    """The group of a 1-D layout: the world, a 1-D DeviceMesh or a ProcessGroup."""
    if mesh is None:
        return dist.group.WORLD
    if isinstance(mesh, dist.ProcessGroup):
        return mesh
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            raise ValueError(
                f"mesh={mesh!r} has {mesh.ndim} dimensions; strategy {strategy!r} uses a 1-D "
                "mesh. Pass mesh[dim_name] for one dimension, or strategy='hybrid_shard' for a "
                "2-D (replicate, shard) mesh"
            )
        return mesh.get_group()
    raise TypeError(
        f"mesh={mesh!r} is a {type(mesh).__name__}; pass None (all ranks), a "
        "torch.distributed.device_mesh.DeviceMesh, or a ProcessGroup"
    )


def _two_groups(mesh) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2:
        raise ValueError(
            f"strategy='hybrid_shard' needs mesh= a 2-D DeviceMesh with dims (replicate, shard), "
            f"got {mesh!r}; e.g. init_device_mesh('cuda', (nodes, gpus_per_node), "
            "mesh_dim_names=('replicate', 'shard'))"
        )
    return mesh.get_group(0), mesh.get_group(1)


def compute_device(group: dist.ProcessGroup) -> torch.device:
    """CUDA (this process's current device) when the group talks NCCL, else CPU."""
    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
