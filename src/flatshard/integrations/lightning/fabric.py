"""``FlatshardStrategy`` for ``lightning.Fabric`` (``strategy="flatshard"``).

``fabric.setup(model, optimizer)`` shards the model (``fs.shard``) and re-points an optimizer
built before sharding at the fragments (it must not have stepped yet), so both orders of
setup work; ``fabric.no_backward_sync`` is ``fs.no_sync``; ``fabric.clip_gradients(max_norm=)``
clips by the global norm; ``fabric.save``/``fabric.load`` go through ``fs.save``/``fs.load``
(or one full file with ``state_dict_type="full"``); ``fabric.init_module(empty_init=True)``
builds on the meta device and ``fs.shard`` materialises one unit at a time.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn

from flatshard.accumulate import no_sync
from flatshard.integrations import common
from flatshard.integrations.lightning import checkpointing
from flatshard.integrations.lightning.base import FlatshardStrategyBase
from flatshard.integrations.lightning.precision import FabricFlatshardPrecision
from flatshard.optim.grad_norm import clip_grad_norm_


class _NoSync(_BackwardSyncControl):
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return no_sync(module) if enabled else nullcontext()


class FlatshardStrategy(FlatshardStrategyBase, ParallelStrategy):
    """Fabric strategy that trains with ``fs.shard``.

    Args:
        policy, strategy, mixed_precision: ``fs.shard``'s (default: ``fs.wrap.auto()``,
            ``"full_shard"``, and the precision plugin's mixed precision).
        state_dict_type: ``"sharded"`` (``fs.save``, every rank writes its shards) or
            ``"full"`` (one ``torch.save`` file on rank 0).
        process_group_backend, timeout: of the process group (default: gloo on CPU).
        **kwargs: Lightning's (``accelerator``, ``parallel_devices``, ``cluster_environment``,
            ``precision``), else any other ``fs.shard`` argument (``offload``, ...).
    """

    flavour = "lightning.Fabric"
    other_flavour = ("lightning.Trainer", "flatshard.integrations.lightning.FlatshardStrategy")
    launcher_cls = _SubprocessScriptLauncher
    lightning_keywords = ("accelerator", "parallel_devices", "cluster_environment", "precision")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._num_nodes = 1
        self._backward_sync_control = _NoSync()

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def precision(self) -> FabricFlatshardPrecision:
        plugin = self._precision
        return plugin if plugin is not None else FabricFlatshardPrecision("32-true")

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        if precision is not None and not isinstance(precision, FabricFlatshardPrecision):
            # Fabric's connector builds its own plugin from precision="..."; take its string
            precision = FabricFlatshardPrecision(str(getattr(precision, "precision", precision)))
        self._precision = precision

    def setup_environment(self) -> None:
        super().setup_environment()
        self._start_process_group(self.precision)

    # ---- module and optimizers -------------------------------------------------------------
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list, scheduler=None):
        names = common.parameter_names(module)
        module = self.setup_module(module)
        for optimizer in optimizers:
            if not common.references_fragments(optimizer, module):
                common.repoint_optimizer(optimizer, names, module)
        return module, optimizers, scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = self._place(module)
        return self._parallelize_and_shard(module, self.precision.mixed_precision)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def module_to_device(self, module: nn.Module) -> None:
        pass  # fs.shard places the shards

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        stack = ExitStack()
        if empty_init:
            stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    # ---- collectives -----------------------------------------------------------------------
    def all_reduce(self, tensor, group: Any | None = None, reduce_op: Any = "mean"):
        return self._mean_or_op(tensor, group, reduce_op)

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        self.precision.unscale_gradients(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)

    # ---- checkpoints -----------------------------------------------------------------------
    def save_checkpoint(self, path, state: dict, storage_options=None, filter=None) -> None:
        if storage_options is not None or filter is not None:
            raise TypeError(
                "FlatshardStrategy.save_checkpoint: storage_options= and filter= are not "
                "supported (fs.save writes every entry of the state)"
            )
        model, optimizer, rest = common.split_state(state)
        if model is None:
            raise ValueError("fabric.save(path, state): state has no module set up by fabric")
        keys = (model[0], optimizer[0] if optimizer else "optimizer")
        optim = optimizer[1] if optimizer else None
        checkpointing.save(path, model[1], optim, rest, self.options.state_dict_type, keys)

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only=None) -> dict:
        if isinstance(state, nn.Module):
            state = {"model": state}
        model, optimizer, _ = common.split_state(dict(state or {}))
        if model is None:
            raise ValueError("fabric.load(path, state): state needs the module set up by fabric")
        keys = (model[0], optimizer[0] if optimizer else "optimizer")
        optim = optimizer[1] if optimizer else None
        saved = checkpointing.load(path, model[1], optim, keys, strict)
        return common.restore_rest(state, saved)
