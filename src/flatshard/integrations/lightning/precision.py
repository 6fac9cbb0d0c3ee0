"""Precision plugins for ``FlatshardStrategy``: Lightning's precision strings, flatshard's way.

| precision | parameters gathered in | gradients reduced in | forward | loss scaling |
|---|---|---|---|---|
| ``32-true`` | fp32 | fp32 | as is | — |
| ``bf16-mixed`` | bf16 (``fs.MixedPrecision``) | fp32 | ``torch.autocast(bf16)`` | — |
| ``16-mixed`` | fp16 | fp32 | ``torch.autocast(fp16)`` | ``fs.GradScaler`` |
| ``bf16-true`` / ``16-true`` | the module is cast | same | inputs cast | — |

The shards (and the optimizer) stay in the module's dtype: fp32 master weights for the mixed
modes. Autocast covers what the casts of the gathered parameters do not (a float input of a
``training_step`` meeting bf16 weights, a loss kept in fp32). ``fs.GradScaler`` shares its
skip decision across ranks, where torch's scaler would decide on one rank's shards.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from flatshard.optim.grad_norm import clip_grad_norm_
from flatshard.optim.grad_scaler import GradScaler
from flatshard.precision import MixedPrecision

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
_LOW = {"bf16": torch.bfloat16, "16": torch.float16}


class _FlatshardPrecisionBase:
    """The part both Lightning flavours share (set up by ``_init``)."""

    precision: str
    scaler: GradScaler | None
    device_type: str

    def _init(self, precision: str, scaler: GradScaler | None) -> None:
        precision = str(precision)
        if precision not in PRECISIONS:
            raise ValueError(
                f"FlatshardPrecision(precision={precision!r}) is not supported; use one of "
                f"{', '.join(PRECISIONS)}"
            )
        if scaler is not None and precision != "16-mixed":
            raise ValueError(f"precision={precision!r} uses no loss scaler; do not pass scaler=")
        if scaler is not None and not isinstance(scaler, GradScaler):
            raise TypeError(
                f"scaler={type(scaler).__name__}: pass a flatshard.GradScaler (its skip decision "
                "is shared by every rank; torch's GradScaler would decide on one rank's shards)"
            )
        self.precision = precision
        self.scaler = scaler if scaler is not None or precision != "16-mixed" else GradScaler()
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self._low = _LOW.get(precision.split("-")[0])

    @property
    def mixed_precision(self) -> MixedPrecision | None:
        """What ``fs.shard(mixed_precision=...)`` gets for this precision."""
        if not self.precision.endswith("-mixed"):
            return None
        return MixedPrecision(param_dtype=self._low, reduce_dtype=torch.float32)

    def _true_dtype(self) -> torch.dtype | None:
        return self._low if self.precision.endswith("-true") else None

    def convert_module(self, module: nn.Module) -> nn.Module:
        dtype = self._true_dtype()
        return module.to(dtype=dtype) if dtype is not None else module

    def tensor_init_context(self) -> AbstractContextManager:
        dtype = self._true_dtype()
        return _DtypeContextManager(dtype) if dtype is not None else nullcontext()

    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    def forward_context(self) -> AbstractContextManager:
        if self.precision.endswith("-mixed"):
            return torch.autocast(self.device_type, dtype=self._low, cache_enabled=False)
        return self.tensor_init_context()

    def convert_input(self, data: Any) -> Any:
        dtype = self._true_dtype()
        if dtype is None:
            return data
        return apply_to_collection(
            data, function=_convert_fp_tensor, dtype=torch.Tensor, dst_type=dtype
        )

    def convert_output(self, data: Any) -> Any:
        if self._true_dtype() is None:
            return data
        default = torch.get_default_dtype()
        return apply_to_collection(
            data, function=_convert_fp_tensor, dtype=torch.Tensor, dst_type=default
        )

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)

    def _scaled_step(self, optimizer: Any, **kwargs: Any) -> Any:
        assert self.scaler is not None
        result = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return result


class FabricFlatshardPrecision(_FlatshardPrecisionBase, FabricPrecision):
    """``lightning.Fabric``'s precision plugin for ``FlatshardStrategy``."""

    def __init__(self, precision: str = "32-true", scaler: GradScaler | None = None) -> None:
        self._init(precision, scaler)

    def backward(self, tensor: torch.Tensor, model: nn.Module | None, *args, **kwargs) -> None:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        tensor.backward(*args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self.scaler is None:
            return optimizer.step(**kwargs)
        return self._scaled_step(optimizer, **kwargs)


class FlatshardPrecision(_FlatshardPrecisionBase, TrainerPrecision):
    """``lightning.Trainer``'s precision plugin for ``FlatshardStrategy``; clipping by norm is
    by the global norm (``fs.clip_grad_norm_``), not each rank's."""

    def __init__(self, precision: str = "32-true", scaler: GradScaler | None = None) -> None:
        self._init(precision, scaler)

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def optimizer_step(
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        skipped = closure_result is None and model.automatic_optimization
        if not skipped:
            # unscale before on_before_optimizer_step, so clipping sees true gradients
            self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        return closure_result if skipped else self._scaled_step(optimizer, **kwargs)

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        clip_grad_norm_(list(self.main_params(optimizer)), clip_val)
