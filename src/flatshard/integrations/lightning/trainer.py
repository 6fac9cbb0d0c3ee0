"""``FlatshardStrategy`` for ``lightning.Trainer`` (``strategy="flatshard"``).

The LightningModule itself is sharded (in place): its blocks become units by the policy, the
rest (embeddings, head) is the root unit. Lightning calls ``training_step`` rather than
``forward``, so the step methods the module defines are registered with
``fs.register_method``: they run with the root unit gathered, like a forward. The optimizer is
built after sharding (``configure_optimizers`` sees the fragments, as with Lightning's FSDP
strategy); gradient accumulation runs its micro-batches under ``fs.no_sync``; clipping by norm
is global; checkpoints go through ``fs.save``/``fs.load`` (a directory) or, with
``state_dict_type="full"``, one Lightning ``.ckpt`` file with the unsharded ``state_dict``.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden

from flatshard.accumulate import no_sync
from flatshard.integrations import common
from flatshard.integrations.lightning import checkpointing
from flatshard.integrations.lightning.base import FlatshardStrategyBase
from flatshard.integrations.lightning.precision import FlatshardPrecision
from flatshard.methods import register_method

STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


class FlatshardStrategy(FlatshardStrategyBase, ParallelStrategy):
    """Trainer strategy that trains with ``fs.shard``.

    Args:
        policy, strategy, mixed_precision: ``fs.shard``'s (default: ``fs.wrap.auto()``,
            ``"full_shard"``, and the mixed precision of the Trainer's ``precision=``).
        state_dict_type: ``"sharded"`` (``fs.save``: a directory, every rank writes its
            shards) or ``"full"`` (one ``.ckpt`` file on rank 0, loadable without flatshard).
        process_group_backend, timeout: of the process group (default: gloo on CPU).
        **kwargs: Lightning's (``accelerator``, ``parallel_devices``, ``cluster_environment``,
            ``checkpoint_io``, ``precision_plugin``), else any other ``fs.shard`` argument.
    """

    strategy_name = "flatshard"
    flavour = "lightning.Trainer"
    other_flavour = (
        "lightning.Fabric",
        "flatshard.integrations.lightning.fabric.FlatshardStrategy",
    )
    launcher_cls = _SubprocessScriptLauncher
    lightning_keywords = (
        "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
        "precision_plugin",
    )  # fmt: skip

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.num_nodes = 1

    @property
    def is_distributed(self) -> bool:
        return True  # Lightning adds a DistributedSampler for strategies that say so

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the optimizer exists (on the fragments) before its state is loaded

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores it

    @property
    def precision_plugin(self) -> FlatshardPrecision:
        plugin = self._precision_plugin
        return plugin if plugin is not None else FlatshardPrecision("32-true")

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, FlatshardPrecision):
            # the Trainer builds its own plugin from precision="..."; keep its string
            plugin = FlatshardPrecision(str(getattr(plugin, "precision", "32-true")))
        self._precision_plugin = plugin

    def setup_environment(self) -> None:
        super().setup_environment()
        self._start_process_group(self.precision_plugin)
        # as Lightning's ModelParallelStrategy: configure_model can read self.device_mesh
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self.device_mesh

    # ---- the model -------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self._place(self.precision_plugin.convert_module(self.model))
        if not common.is_sharded(self.model):
            # in place: the LightningModule stays the model (parallelize_fn's result unused)
            self._parallelize_and_shard(self.model, self.precision_plugin.mixed_precision)
            module = self.lightning_module
            for name in STEP_METHODS:
                if is_overridden(name, module):
                    register_method(self.model, name)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def model_to_device(self) -> None:
        pass  # fs.shard places the shards

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        meta = torch.device("meta") if empty_init else nullcontext()
        with meta, self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Micro-batches of gradient accumulation: accumulate, reduce on the last one only."""
        if self.model is not None and common.is_sharded(self.model):
            with no_sync(self.model):
                yield
        else:
            yield

    # ---- collectives -----------------------------------------------------------------------
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return self._mean_or_op(tensor, group, reduce_op)

    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ---- checkpoints -----------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # save_checkpoint writes the model itself (sharded, or gathered for "full")

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}  # likewise

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # load_checkpoint has loaded it

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("FlatshardStrategy.save_checkpoint(storage_options=) is not supported")
        path = self.broadcast(str(filepath))
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        checkpointing.save(
            path,
            self.model,
            self._the_optimizer(),
            rest,
            self.options.state_dict_type,
            ("state_dict", "optimizer_states"),
            optimizer_in_list=True,
        )

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        path = self.broadcast(str(checkpoint_path))
        strict = getattr(self.lightning_module, "strict_loading", True)
        return checkpointing.load(
            path,
            self.model,
            self._the_optimizer(),
            ("state_dict", "optimizer_states"),
            strict,
            optimizer_in_list=True,
        )

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            import shutil
            from pathlib import Path

            path = Path(filepath)
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)

    def _the_optimizer(self) -> torch.optim.Optimizer | None:
        if len(self.optimizers) > 1:
            raise ValueError(
                f"FlatshardStrategy checkpoints one optimizer; configure_optimizers returned "
                f"{len(self.optimizers)}: use one optimizer with several param groups"
            )
        return self.optimizers[0] if self.optimizers else None
