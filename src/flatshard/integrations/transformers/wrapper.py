"""The module the HF Trainer steps through: the sharded model, with ``no_sync`` and autocast.

The Trainer hands a model that ``_wrap_model`` returned *unchanged* to
``accelerator.prepare``, which wraps it in DDP on a multi-process run. Returning this thin
wrapper instead takes the Trainer's "model is already wrapped" path (as for DataParallel or
SageMaker): Accelerate prepares the data and the optimizer only. ``accelerator.no_sync(model)``
uses ``model.no_sync`` when there is one: gradient accumulation reduces once per step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from flatshard.accumulate import no_sync


class ShardedModel(nn.Module):
    """Calls the sharded ``module``; under ``bf16``/``fp16`` inside ``torch.autocast``."""

    def __init__(self, module: nn.Module, autocast_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.module = module
        self.autocast_dtype = autocast_dtype

    def forward(self, *args, **kwargs):
        with self._autocast():
            return self.module(*args, **kwargs)

    def _autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        device = next(self.module.parameters()).device.type
        return torch.autocast(device, dtype=self.autocast_dtype)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        with no_sync(self.module):
            yield
