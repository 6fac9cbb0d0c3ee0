"""What ``FlatshardStrategy`` shares between Lightning's two flavours (Trainer and Fabric):
the constructor (flatshard's options; Lightning's own keywords passed on), devices and ranks,
the launcher, the process group, the small collectives, and placing a module before sharding.

Each flavour mixes this in front of its own ``ParallelStrategy`` and names, as class
attributes, its launcher class, the constructor keywords its base takes, and which flavour it
is for.

[Note: one class per flavour]
One class for both flavours is not sound: it would have to derive from both Lightning
``Strategy`` bases, which share method names with different signatures and meanings
(``backward(closure_loss, optimizer)`` vs ``backward(tensor, module)``,
``save_checkpoint(checkpoint, filepath)`` vs ``save_checkpoint(path, state)``,
``load_checkpoint``, ``optimizer_step``, ``tensor_init_context``), so one MRO would call the
other flavour's method with the wrong arguments. Lightning has one ``FSDPStrategy`` per flavour
for the same reason. Passing one flavour's instance to the other is refused by Lightning's own
check, whose message shows the strategy's ``repr``: :meth:`FlatshardStrategyBase.__repr__`
names the class to use instead, so that message carries the fix.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, ClassVar

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning_utilities.core.rank_zero import rank_zero_only
from torch import nn

from flatshard.integrations import common
from flatshard.integrations.lightning import tp_setup as tp
from flatshard.integrations.lightning.options import (
    StrategyOptions,
    collect_options,
    init_process_group,
)
from flatshard.precision import MixedPrecision


class FlatshardStrategyBase:
    """Mixin; see the module docstring."""

    launcher_cls: ClassVar[type]
    lightning_keywords: ClassVar[tuple[str, ...]]
    flavour: ClassVar[str]  # "lightning.Trainer" or "lightning.Fabric"
    other_flavour: ClassVar[tuple[str, str]]  # (the other flavour, its strategy class)
    options: StrategyOptions

    def __init__(
        self,
        policy: Any = None,
        strategy: Any = None,
        mixed_precision: MixedPrecision | None = None,
        state_dict_type: str = "sharded",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        tensor_parallel_size: int = 1,
        parallelize_fn: tp.ParallelizeFn | None = None,
        **kwargs: Any,
    ) -> None:
        lightning = {k: kwargs.pop(k) for k in self.lightning_keywords if k in kwargs}
        super().__init__(**lightning)
        tp.check_arguments(tensor_parallel_size, parallelize_fn)
        self.tensor_parallel_size, self.parallelize_fn = tensor_parallel_size, parallelize_fn
        self._device_mesh: Any = None
        self.options = collect_options(
            policy, strategy, mixed_precision, state_dict_type, process_group_backend, timeout,
            kwargs,
        )  # fmt: skip

    def __repr__(self) -> str:
        # Lightning's "invalid strategy" error quotes this: it must name the right class
        other, other_class = self.other_flavour
        cls = type(self)
        return (
            f"<{cls.__module__}.{cls.__qualname__} for {self.flavour}; for {other} use "
            f"{other_class}(...) or strategy='flatshard'>"
        )

    # ---- where and how many ----------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """By the data-parallel rank: the tp ranks of a group read the same batches."""
        world = self.num_nodes * self.num_processes
        return tp.sampler_kwargs(world, self.global_rank, self.tensor_parallel_size)

    @property
    def device_mesh(self) -> Any:
        """The ``("dp", "tp")`` DeviceMesh (built when the process group starts)."""
        if self._device_mesh is None:
            raise RuntimeError(
                "FlatshardStrategy.device_mesh is built when the processes have started "
                "(setup_environment); read it from then on, e.g. in configure_model"
            )
        return self._device_mesh

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = self.launcher_cls(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            rank = self.node_rank * self.num_processes + self.local_rank
            self.cluster_environment.set_global_rank(rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # the one object both flavours re-export

    def _start_process_group(self, precision_plugin: Any) -> None:
        """After the base's ``setup_environment``: torch.distributed up, autocast's device."""
        init_process_group(self, self.options)
        precision_plugin.device_type = self.root_device.type
        world = self.num_nodes * self.num_processes
        self._device_mesh = tp.build_mesh(self.root_device.type, world, self.tensor_parallel_size)

    def _parallelize_and_shard(self, module: nn.Module, mixed_precision: Any) -> nn.Module:
        """``parallelize_fn`` with the whole mesh, then ``fs.shard`` (over ``mesh["dp"]`` when
        the module is tensor-parallel); see tp_setup.py."""
        if common.is_sharded(module):
            return module
        module = tp.parallelize(
            module, self.parallelize_fn, self._device_mesh, self.tensor_parallel_size
        )
        kwargs = self.options.shard_kwargs_with(mixed_precision)
        return common.shard_module(module, tp.shard_kwargs(module, kwargs, self._device_mesh))

    def _place(self, module: nn.Module) -> nn.Module:
        """On the strategy's device before ``fs.shard`` (a meta-built module stays: fs.shard
        materialises it unit by unit)."""
        on_meta = any(t.device.type == "meta" for t in module.parameters())
        if self.root_device.type == "cpu" or on_meta:
            return module
        return module.to(self.root_device)

    # ---- small collectives -----------------------------------------------------------------
    def _mean_or_op(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _distributed_is_initialized():
            torch.distributed.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        holder = [obj]
        torch.distributed.broadcast_object_list(holder, src, group=_group.WORLD)
        return holder[0]

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "flatshard", cls, description="flatshard: fully sharded data parallel", override=True
        )
