"""``fs.MixedPrecision``: compute and communicate in a low precision, keep fp32 master shards.

What flatshard does with it:
- The sharded parameters the optimizer sees keep their own dtype (fp32: the master copy).
- Before each gather, a unit's shard is cast to ``param_dtype`` once, so the all-gather moves
  (and the gathered buffer holds) half the bytes for bf16/fp16; forward and backward compute on
  those low-precision full parameters.
- Gradients are flattened and reduced in ``reduce_dtype`` (default: ``param_dtype``) and cast
  into the fp32 fragments' ``.grad``. In fp16, each rank divides by ~sqrt(N) before the sum
  and the result by N/sqrt(N) after, so that summing N ranks cannot overflow fp16's 65504.
- Floating buffers are cast once to ``buffer_dtype`` when given (default: kept, so running
  statistics of norms stay fp32). Floating inputs of the root module are cast to
  ``param_dtype`` (``cast_forward_inputs``), its floating outputs to ``output_dtype`` when given
  (use ``torch.float32`` to compute the loss in fp32).

[Note: CPU vs CUDA numerics]
flatshard casts parameters; it does not use autocast. Every op then runs in the dtype of its
inputs, on either device: layer_norm/softmax on bf16 inputs run in bf16 on CPU *and* on CUDA
(autocast would upcast them on CUDA but not on CPU). Pass ``output_dtype=torch.float32`` and
compute the loss outside the model, in fp32.

``fs.Comm`` (below) is the other half: not the dtype gradients are summed in, but the format
they travel in (``fs.shard(comm=fs.Comm(reduce="bf16"))``, see docs/mixed_precision.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MixedPrecision:
    """Mixed-precision settings for ``fs.shard(mixed_precision=...)``."""

    param_dtype: torch.dtype | None = None
    """dtype of the gathered parameters that forward/backward compute with (None: as stored)."""

    reduce_dtype: torch.dtype | None = None
    """dtype of gradient communication (None: ``param_dtype``)."""

    buffer_dtype: torch.dtype | None = None
    """dtype floating buffers are cast to once, at shard time (None: keep them)."""

    output_dtype: torch.dtype | None = None
    """dtype the root module's floating outputs are cast to (None: leave them)."""

    cast_forward_inputs: bool = True
    """Cast the root module's floating inputs to ``param_dtype``."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, torch.dtype) and value.is_floating_point
            ):
                raise ValueError(
                    f"MixedPrecision({name}={value!r}): pass a floating torch dtype such as "
                    "torch.bfloat16, torch.float16 or torch.float32 (or None)"
                )

    @property
    def effective_reduce_dtype(self) -> torch.dtype | None:
        return self.reduce_dtype if self.reduce_dtype is not None else self.param_dtype


# The wire formats ``Comm.reduce`` accepts, and the dtype each sends.
REDUCE_WIRES = {"bf16": torch.bfloat16}
# The blockwise-quantized ones (codes + one fp32 scale per block: comm/quantize.py), and the
# dtype of their codes. ``fp8`` is float8 e4m3 (3 mantissa bits: the gradient format).
QUANTIZED_WIRES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class Comm:
    """How flatshard's collectives move data, for ``fs.shard(comm=...)``: the wire format,
    apart from the dtypes of ``MixedPrecision`` (which say what is computed and summed in).
    Every rank must pass the same (it is part of ``fs.shard``'s cross-rank fingerprint)."""

    reduce: str | None = None
    """How a gradient travels in the shard group's reduction. ``None`` (default): in
    ``reduce_dtype``, by a reduce-scatter that sums along the way. ``"bf16"``: when
    ``reduce_dtype`` is fp32, as bf16 in an all-to-all (rank ``r`` receives every rank's chunk
    ``r``), summed in fp32 where it arrives: half the bytes of the fp32 reduce-scatter, and
    under bf16 compute (gradients are bf16 already) the same sum up to its order. With any
    other ``reduce_dtype``, and under ``no_shard``, it has no effect (``fs.shard`` warns).
    ``"int8"`` / ``"fp8"`` (e4m3): quantized blockwise (one fp32 scale per 256 elements,
    comm/quantize.py), sent in an all-to-all, dequantized and summed in fp32 where they
    arrive: 1 byte + 4/256 per element, for any floating ``reduce_dtype``
    (docs/low_precision.md)."""

    error_feedback: bool = False
    """With ``reduce="int8"``/``"fp8"``: each rank keeps what quantization dropped from its
    gradient (the residual, an fp32 copy of its flat gradient's size) and adds it to the next
    step's gradient before quantizing, so the error does not accumulate over steps
    (features/error_feedback.py). It is training state: ``fs.save``/``fs.load`` keep it, at
    any world size. A field of ``Comm`` because it belongs to the wire format (it means
    nothing without a lossy one) and, like it, must agree on every rank (the fingerprint)."""

    gather: str | None = None
    """How a unit's parameters travel in its all-gather. ``None`` (default): in the compute
    dtype. ``"int8"`` / ``"fp8"`` (e4m3): each rank's shard quantized blockwise (as
    ``reduce``'s), gathered as bytes and dequantized into the compute dtype where they
    arrive: 1 byte + 4/256 per element, for a compute dtype wider than one byte.
    ``"bf16"``: sent as bf16 and upcast where the compute dtype is fp32 (no effect under a
    bf16/fp16 compute dtype: ``fs.shard`` warns). Gradients are untouched. See [Note:
    quantized weight gather] in features/quantized_gather.py."""

    def __post_init__(self) -> None:
        wires = {**REDUCE_WIRES, **QUANTIZED_WIRES}
        for name in ("reduce", "gather"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or value not in wires):
                choices = ", ".join(["None", *(repr(wire) for wire in wires)])
                raise ValueError(f"Comm({name}={value!r}) is unknown; choose one of {choices}")
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"Comm(error_feedback={self.error_feedback!r}): pass True or False")
        if self.error_feedback and self.reduce not in QUANTIZED_WIRES:
            raise ValueError(
                f"Comm(reduce={self.reduce!r}, error_feedback=True): error feedback corrects a "
                "quantized wire and has nothing to correct here; pass reduce='int8' or "
                "reduce='fp8', or error_feedback=False"
            )

    @property
    def quantized(self) -> bool:
        return self.reduce in QUANTIZED_WIRES


def wire_dtype(reduce_wire: str | None, reduce_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a ``reduce_dtype`` gradient travels in under ``Comm(reduce=reduce_wire)``, or
    None where that changes nothing (no wire format, or one no narrower than the sum's dtype:
    a bf16 or fp16 ``reduce_dtype`` keeps its reduce-scatter under ``"bf16"``). A quantized
    wire (int8/fp8) returns its code dtype for every wider floating ``reduce_dtype``."""
    wires = {**REDUCE_WIRES, **QUANTIZED_WIRES}
    wire = wires.get(reduce_wire) if reduce_wire is not None else None
    if wire is None or not reduce_dtype.is_floating_point:
        return None
    return wire if reduce_dtype.itemsize > wire.itemsize else None


def compute_dtype(stored: torch.dtype, mp: MixedPrecision | None) -> torch.dtype:
    """The dtype a group of ``stored``-dtype parameters is gathered in."""
    if mp is None or mp.param_dtype is None or not stored.is_floating_point:
        return stored
    return mp.param_dtype


def reduce_dtype(stored: torch.dtype, mp: MixedPrecision | None) -> torch.dtype:
    """The dtype the gradients of a group of ``stored``-dtype parameters are reduced in."""
    if mp is None or mp.effective_reduce_dtype is None or not stored.is_floating_point:
        return stored
    return mp.effective_reduce_dtype


def sum_scaling(dtype: torch.dtype, world: int) -> tuple[float, float]:
    """(divide before, divide after) the cross-rank sum: their product is ``world`` (a mean).
    fp16 splits it ~sqrt(world) each so neither the addends nor the sum overflow."""
    if dtype is torch.float16 and world > 1:
        pre = float(2 ** round(math.log2(math.sqrt(world))))
        return pre, world / pre
    return 1.0, float(world)


def cast_floating(tree: Any, dtype: torch.dtype | None) -> Any:
    """Cast every floating tensor in a pytree of args/outputs to ``dtype`` (None: unchanged)."""
    if dtype is None:
        return tree

    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)
