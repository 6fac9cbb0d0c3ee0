"""Tensor parallelism under ``FlatshardStrategy(tensor_parallel_size=N, parallelize_fn=...)``.

As Lightning's ``ModelParallelStrategy(data_parallel_size, tensor_parallel_size)``: after the
process group is up the strategy builds a ``DeviceMesh`` of shape ``(world // N, N)`` named
``("dp", "tp")`` (the ranks of one tp group are consecutive), exposes it as
``strategy.device_mesh`` and as the LightningModule's ``self.device_mesh`` (readable in
``configure_model``), and makes the distributed sampler split the data by the dp rank and size:
every tp rank of a group sees the same batches. Before ``fs.shard`` it calls
``parallelize_fn(module, device_mesh)`` with the whole mesh (the function applies its plan on
``device_mesh["tp"]``); a module with tensor-parallel (DTensor) parameters is then sharded over
``device_mesh["dp"]``. Without ``parallelize_fn`` the module may be made tensor-parallel in
``configure_model``; ``tensor_parallel_size > 1`` with no DTensor parameter by the time the
module is sharded is an error (the tp ranks would silently train the same replica).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from flatshard.parallel.tensor import model_tp_mesh

ParallelizeFn = Callable[[nn.Module, Any], nn.Module | None]


def check_arguments(tensor_parallel_size: Any, parallelize_fn: Any) -> None:
    """``TypeError``/``ValueError`` for arguments that cannot work, naming the fix."""
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int):
        raise TypeError(
            f"FlatshardStrategy(tensor_parallel_size={tensor_parallel_size!r}) must be an int "
            "(the ranks of one tensor-parallel group), e.g. 2"
        )
    if tensor_parallel_size < 1:
        raise ValueError(
            f"FlatshardStrategy(tensor_parallel_size={tensor_parallel_size}) must be >= 1 "
            "(1 = no tensor parallelism)"
        )
    if parallelize_fn is not None and not callable(parallelize_fn):
        raise TypeError(
            f"FlatshardStrategy(parallelize_fn={parallelize_fn!r}) must be a function "
            "(module, device_mesh) -> module, applying its plan on device_mesh['tp']"
        )


def build_mesh(device_type: str, world: int, tp: int) -> Any:
    """The ``("dp", "tp")`` mesh of the job; ``ValueError`` if ``tp`` does not divide it."""
    from torch.distributed.device_mesh import init_device_mesh

    if world % tp:
        raise ValueError(
            f"FlatshardStrategy(tensor_parallel_size={tp}) does not divide the world size "
            f"{world} (devices x num_nodes); choose a tensor_parallel_size that divides {world}"
        )
    return init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))


def sampler_kwargs(world: int, rank: int, tp: int) -> dict[str, int]:
    """The distributed sampler's replicas and rank: the data-parallel ones."""
    return {"num_replicas": world // tp, "rank": rank // tp}


def parallelize(module: nn.Module, fn: ParallelizeFn | None, mesh: Any, tp: int) -> nn.Module:
    """``fn(module, mesh)`` (its result, or ``module`` when it returns None); refuses a module
    left without tensor-parallel parameters when ``tp > 1``."""
    if fn is not None:
        result = fn(module, mesh)
        module = module if result is None else result
    if tp > 1 and model_tp_mesh(module) is None:
        raise ValueError(
            f"FlatshardStrategy(tensor_parallel_size={tp}): the module has no tensor-parallel "
            "(DTensor) parameters, so its tp ranks would train the same replica; pass "
            "parallelize_fn=(module, device_mesh) -> module applying parallelize_module on "
            "device_mesh['tp'], or apply it in configure_model with self.device_mesh['tp']"
        )
    return module


def shard_kwargs(module: nn.Module, kwargs: dict[str, Any], mesh: Any) -> dict[str, Any]:
    """``fs.shard``'s kwargs: over ``mesh["dp"]`` when the module is tensor-parallel (unless
    the user chose a mesh)."""
    if mesh is None or "mesh" in kwargs or model_tp_mesh(module) is None:
        return kwargs
    return {**kwargs, "mesh": mesh["dp"]}
