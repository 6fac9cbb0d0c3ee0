"""``fs.Comm(reduce="int8"|"fp8", error_feedback=True)``: the quantization residual of each rank.

Each rank quantizes its own flat gradient (all ``world`` chunks of it) before the all-to-all;
what the quantization drops, ``grad + residual - dequantized(quantized)``, is kept and added to
the next reduction's gradient before it is quantized (``quantize_with_feedback``). Over steps
the quantized updates then sum to the exact ones up to the last residual: the error stays
bounded instead of growing with the number of steps.

[Note: error-feedback residuals in checkpoints]
A residual is per rank and covers the rank's whole flat gradient (its own contribution to every
chunk), so it is not sharded like the parameters and means nothing at another world size. What
the training curve depends on is only the correction still owed to the *averaged* gradient:
``M = sum over ranks of residual_r / D`` (``D``: the data-parallel divisor), since the next
averaged gradient is ``mean(g_r) + M``. ``M`` has the parameters' layout, so it is saved as
parameters are: each rank computes its shard of it (a reduce-scatter of the residuals, then
over the replicas) and writes it under ``flatshard.error_feedback/<parameter name>``
(checkpoint/residuals.py). On load, at any world size, each rank puts ``M``'s shard it owns,
times ``D / replicas``, into its own chunk of its residual, and zeros elsewhere
(``restore_residuals``): the sum over ranks divided by the new ``D`` is ``M`` again, so the
owed correction is carried over exactly (up to fp32 rounding). Only how it is spread over the
ranks changes, which moves the next quantization's rounding, not the correction.
A checkpoint saved without error feedback loads with zero residuals; one saved with it loads
into a model without it by ignoring the residual.
"""

from __future__ import annotations

import copy
import weakref

import torch

from flatshard.comm.quantize import dequantize, quantize


class Residuals:
    """Per-model store: each trainable flat group's fp32 residual (``padded_numel``, on the
    group's compute device), created at zero on first use."""

    def __init__(self) -> None:
        # weak: a group that is gone takes its residual along
        self.by_group: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __deepcopy__(self, memo: dict) -> Residuals:
        copied = Residuals()  # keyed by the copied groups (deepcopy's memo: the same objects)
        for group, residual in self.by_group.items():
            copied.by_group[copy.deepcopy(group, memo)] = residual.clone()
        return copied

    def of(self, group) -> torch.Tensor:
        residual = self.by_group.get(group)
        if residual is None:
            residual = torch.zeros(group.padded_numel, dtype=torch.float32, device=group.device)
            self.by_group[group] = residual
        return residual


def quantize_with_feedback(
    rows: torch.Tensor, fmt: str, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``rows`` (``[world, S]``) blockwise; with a ``residual`` (``[world * S]``,
    fp32) quantize ``rows + residual`` instead and leave in ``residual`` what was lost."""
    if residual is None:
        return quantize(rows, fmt)
    target = rows.float() + residual.view(rows.shape)
    codes, scales = quantize(target, fmt)
    residual.copy_((target - dequantize(codes, scales)).view(-1))
    return codes, scales
