"""``FlatshardTrainer``: ``transformers.Trainer``, sharded by flatshard.

What changes against the stock Trainer (everything else is the Trainer's own code):
- the model is sharded before the optimizer is built (``create_optimizer`` sees fragments;
  weight-decay grouping is by name, so it is unchanged) and stepped through ``ShardedModel``;
- clipping and the logged ``grad_norm`` use the global norm (``fs.clip_grad_norm_``);
- ``bf16=True``/``fp16=True``: parameters gathered in that dtype, gradients reduced in fp32,
  forward under autocast (fp16 loss scaling: not supported, use bf16);
- checkpoints: ``checkpoint-N/`` holds the ``from_pretrained`` files (``fs.save_pretrained``)
  plus ``flatshard/`` (``fs.save``: model and optimizer shards, any world size on resume); the
  scheduler, RNG and trainer state are the Trainer's own files. ``save_model()`` writes a
  ``from_pretrained`` directory.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import transformers
from torch import nn

from flatshard import checkpoint as fs_checkpoint
from flatshard.integrations import common
from flatshard.integrations.common import no_split_policy
from flatshard.integrations.transformers.wrapper import ShardedModel
from flatshard.introspect import is_sharded
from flatshard.optim.grad_norm import clip_grad_norm_
from flatshard.precision import MixedPrecision

FLATSHARD_DIR = "flatshard"
SCHEDULER_NAME = "scheduler.pt"


class FlatshardTrainerMixin:
    """The flatshard behaviour, for ``transformers.Trainer`` and its subclasses."""

    def __init__(self, *args: Any, shard_kwargs: dict | None = None, **kwargs: Any) -> None:
        self.shard_kwargs = dict(shard_kwargs or {})
        super().__init__(*args, **kwargs)
        if self.args.fp16:
            raise ValueError(
                "FlatshardTrainer: fp16=True needs a loss scaler shared by the shards, which "
                "Accelerate's is not; use bf16=True (or a Lightning FlatshardStrategy for fp16)"
            )

    # ---- sharding ---------------------------------------------------------------------------
    def _shard_kwargs(self) -> dict:
        kwargs = dict(self.shard_kwargs)
        kwargs.setdefault("policy", no_split_policy(self.model))
        if self.args.bf16 and kwargs.get("mixed_precision") is None:
            kwargs["mixed_precision"] = MixedPrecision(torch.bfloat16, torch.float32)
        return kwargs

    def _ensure_sharded(self) -> None:
        if not is_sharded(self.model):
            common.shard_module(self.model, self._shard_kwargs())

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        self._ensure_sharded()  # the optimizer must hold the fragments
        return super().create_optimizer(None if isinstance(model, ShardedModel) else model)

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None) -> nn.Module:
        if isinstance(model, ShardedModel):
            return model
        self._ensure_sharded()
        dtype = torch.bfloat16 if self.args.bf16 else None
        return ShardedModel(self.model, dtype)

    # ---- gradient norm ------------------------------------------------------------------------
    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return clip_grad_norm_(self.model, self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> float:
        if grad_norm is None:
            grad_norm = clip_grad_norm_(self.model, float("inf"))
        return super()._get_grad_norm(model, grad_norm)

    # ---- checkpoints --------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A ``from_pretrained`` directory (every rank must call it, as the Trainer does)."""
        output_dir = output_dir or self.args.output_dir
        if not is_sharded(self.model):
            return super().save_model(output_dir, _internal_call)
        fs_checkpoint.save_pretrained(self.model, output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # Accelerate's wrapper
        fs_checkpoint.save(
            os.path.join(output_dir, FLATSHARD_DIR), model=self.model, optimizer=optimizer
        )
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # before sharding the Trainer would load full weights here; the shards come with the
        # optimizer, in _load_optimizer_and_scheduler, once both exist
        if not os.path.isdir(os.path.join(resume_from_checkpoint, FLATSHARD_DIR)):
            raise ValueError(
                f"{resume_from_checkpoint} has no {FLATSHARD_DIR}/ (not written by a "
                "FlatshardTrainer); load its weights with fs.load(path, model=...) instead"
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        fs_checkpoint.load(
            os.path.join(checkpoint, FLATSHARD_DIR), model=self.model, optimizer=optimizer
        )
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))


class FlatshardTrainer(FlatshardTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with the model sharded by ``fs.shard``: the same constructor,
    plus ``shard_kwargs`` (``fs.shard``'s arguments; default policy: the model's
    ``_no_split_modules`` classes)."""
