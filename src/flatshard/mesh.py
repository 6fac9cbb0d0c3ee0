"""Resolving ``mesh=`` into the process group(s) flatshard communicates over, and the device."""

from __future__ import annotations

import torch
import torch.distributed as dist


def require_initialized() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "fs.shard needs torch.distributed to be initialised: call "
            "torch.distributed.init_process_group('gloo' or 'nccl') first, or launch with torchrun"
        )


def shard_group(mesh) -> dist.ProcessGroup:
    """The group parameters are sharded over: the world, a 1-D DeviceMesh or a ProcessGroup."""
    if mesh is None:
        return dist.group.WORLD
    if isinstance(mesh, dist.ProcessGroup):
        return mesh
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            raise ValueError(
                f"mesh={mesh!r} has {mesh.ndim} dimensions; strategy 'full_shard' shards over a "
                "1-D mesh. Pass mesh[dim_name] for one dimension (a 2-D mesh is for hybrid_shard)"
            )
        return mesh.get_group()
    raise TypeError(
        f"mesh={mesh!r} is a {type(mesh).__name__}; pass None (all ranks), a "
        "torch.distributed.device_mesh.DeviceMesh, or a ProcessGroup"
    )


def compute_device(group: dist.ProcessGroup) -> torch.device:
    """CUDA (this process's current device) when the group talks NCCL, else CPU."""
    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
