"""``fs.shard``'s arguments, checked and defaulted: ``ShardOptions``.

Every argument that is not the model, the policy or the mesh lands here; a wrong type or value
raises before anything is communicated, naming the argument and the fix.
"""

from __future__ import annotations

import datetime
import os
import warnings
from dataclasses import dataclass

from torch import nn

from flatshard.coalesce import Coalesce
from flatshard.core.meta_init import InitFn, has_meta, model_init_fn
from flatshard.core.state import STATE_ATTR
from flatshard.core.strategy import ShardingStrategy, reshards_after_forward
from flatshard.offload import CPUOffload
from flatshard.parallel.tensor import spec_of
from flatshard.precision import LOW_PRECISION, Comm, MixedPrecision
from flatshard.prefetch import Prefetch

DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ShardOptions:
    """``fs.shard``'s arguments, checked (``parse_options``), one field each."""

    strategy: ShardingStrategy
    """``full_shard`` (ZeRO-3), ``shard_grad_op`` (ZeRO-2), ``no_shard`` (DDP) or
    ``hybrid_shard`` (a 2-D mesh: shard within a row, replicate across rows)."""
    mixed_precision: MixedPrecision | None
    """``fs.MixedPrecision``: compute and reduction dtypes over fp32 master shards."""
    offload: CPUOffload | None
    """``fs.CPUOffload(params=True)``: shards and their optimizer state live on the CPU."""
    timeout: datetime.timedelta
    """Bounds every wait on a peer (``timeout_s``; default ``$FLATSHARD_TIMEOUT_S`` or 600 s)."""
    init_fn: InitFn | None
    """For a model built under ``torch.device("meta")``: ``init_fn(unit_module)`` initialises
    each unit as it is materialised (peak memory: one unit). Default: a transformers model's
    own ``_init_weights``, otherwise the unit module's ``reset_parameters()`` (or its
    children's); see ``flatshard.core.meta_init``."""
    prefetch: Prefetch
    """``fs.Prefetch(forward=..., backward=...)``: how many units to gather ahead."""
    reshard_root: bool
    """Under ``full_shard``/``hybrid_shard`` the root unit stays gathered from its forward into
    its backward (default, as FSDP2: its backward comes first, so a reshard would only regather
    it). ``True`` releases it after forward like any unit: its gathered bytes are free while
    the loss is computed, for one all-gather more a step."""
    coalesce: Coalesce
    """Small units that run one after another share one all-gather and one reduce-scatter
    (``fs.Coalesce``: default on, for units up to 2 MiB, chosen from the first iteration's
    forward order; ``False`` turns it off). Results are identical either way."""
    split_root: bool
    """The root's parameters used only after the last unit (final norm, output head) form a
    unit of their own over the root module, gathered with the root but reduced and released
    as soon as their backward is done (see ``features/root_split.py``)."""
    comm: Comm
    """``fs.Comm(reduce="bf16")``: the wire format of the gradient reduction (default
    ``fs.Comm()``: gradients travel in ``reduce_dtype``); see docs/mixed_precision.md."""


def parse_options(
    model,
    strategy,
    mixed_precision,
    offload,
    timeout_s,
    init_fn,
    prefetch,
    reshard_root,
    coalesce,
    split_root,
    comm=None,
) -> ShardOptions:
    _check_model(model)
    try:
        parsed = ShardingStrategy(strategy)
    except ValueError:
        choices = ", ".join(repr(s.value) for s in ShardingStrategy)
        raise ValueError(f"strategy={strategy!r} is unknown; choose one of {choices}") from None
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(
            f"mixed_precision={mixed_precision!r}: pass fs.MixedPrecision(param_dtype=...)"
        )
    if offload is not None and not isinstance(offload, CPUOffload):
        raise TypeError(f"offload={offload!r}: pass fs.CPUOffload(params=True)")
    if prefetch is not None and not isinstance(prefetch, Prefetch):
        raise TypeError(f"prefetch={prefetch!r}: pass fs.Prefetch(forward=..., backward=...)")
    if reshard_root and not reshards_after_forward(parsed):
        warnings.warn(
            f"fs.shard(reshard_root=True) has no effect with strategy={parsed.value!r}: its "
            "units stay gathered until their backward (use full_shard or hybrid_shard)",
            stacklevel=3,
        )
    comm = _comm(comm, parsed, mixed_precision)
    _check_gather(model, comm, parsed, mixed_precision, offload)
    prefetch = prefetch if prefetch is not None else Prefetch()
    timeout = _timeout(timeout_s)
    if init_fn is None and has_meta(model):
        init_fn = model_init_fn(model)  # a transformers model: its own _init_weights
    return ShardOptions(
        parsed, mixed_precision, offload, timeout, init_fn, prefetch, reshard_root,
        _coalesce(coalesce), bool(split_root), comm,
    )  # fmt: skip


def _coalesce(coalesce: Coalesce | bool | None) -> Coalesce:
    if coalesce is None or coalesce is True:
        return Coalesce()
    if coalesce is False:
        return Coalesce(unit_bytes=0)
    if not isinstance(coalesce, Coalesce):
        raise TypeError(
            f"coalesce={coalesce!r}: pass fs.Coalesce(unit_bytes=..., bucket_bytes=...), "
            "True (the default) or False"
        )
    return coalesce


def _comm(comm: Comm | None, strategy: ShardingStrategy, mp: MixedPrecision | None) -> Comm:
    """``comm`` checked, with a warning where its wire format cannot change anything."""
    if comm is None:
        return Comm()
    if not isinstance(comm, Comm):
        raise TypeError(f"comm={comm!r}: pass fs.Comm(reduce='bf16') (or None)")
    if comm.reduce is None:
        return comm
    if comm.error_feedback and strategy is ShardingStrategy.NO_SHARD:
        raise ValueError(  # a residual that would never exist must not look checkpointed
            f"fs.shard(strategy='no_shard', comm=fs.Comm(reduce={comm.reduce!r}, "
            "error_feedback=True)): no_shard all-reduces unquantized gradients, so there is no "
            "quantization residual to keep or checkpoint; use a sharded strategy or drop comm="
        )
    low = mp.effective_reduce_dtype if mp is not None else None
    low = None if comm.quantized else low  # int8/fp8 are narrower than any reduce_dtype
    if strategy is ShardingStrategy.NO_SHARD or low in LOW_PRECISION:
        why = (
            "no_shard has no reduce-scatter (its gradients are all-reduced)"
            if strategy is ShardingStrategy.NO_SHARD
            else f"gradients already travel in reduce_dtype={low}"
        )
        warnings.warn(
            f"fs.shard(comm=fs.Comm(reduce={comm.reduce!r})) has no effect: {why}; it applies "
            "to an fp32 reduce_dtype (int8/fp8: any) under a sharded strategy",
            stacklevel=4,
        )
    return comm


def _check_gather(
    model: nn.Module,
    comm: Comm,
    strategy: ShardingStrategy,
    mp: MixedPrecision | None,
    offload: CPUOffload | None,
) -> None:
    """``comm.gather`` refused where its path is not built, warned where it changes nothing
    (see [Note: quantized weight gather] in features/quantized_gather.py)."""
    if comm.gather is None:
        return
    asked = f"fs.shard(comm=fs.Comm(gather={comm.gather!r}))"
    if offload is not None and offload.params:
        raise ValueError(
            f"{asked} with fs.CPUOffload(params=True): the quantized gather of offloaded "
            "shards is not supported; drop offload= or pass gather=None"
        )
    tp = next((n for n, p in model.named_parameters() if spec_of(p) is not None), None)
    if tp is not None:
        raise ValueError(
            f"{asked}: parameter {tp!r} is tensor-parallel, which the quantized gather does "
            "not support; pass gather=None"
        )
    compute = mp.param_dtype if mp is not None else None
    if strategy is ShardingStrategy.NO_SHARD or (
        comm.gather == "bf16" and compute in LOW_PRECISION
    ):
        why = (
            "no_shard gathers nothing"
            if strategy is ShardingStrategy.NO_SHARD
            else f"parameters already travel in param_dtype={compute}"
        )
        warnings.warn(
            f"{asked} has no effect: {why}; 'bf16' applies to an fp32 compute dtype, "
            "'int8'/'fp8' to any, under a sharded strategy",
            stacklevel=4,
        )


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"fs.shard(model=...) got a {type(model).__name__}; pass a torch.nn.Module")
    for name, sub in model.named_modules():
        if hasattr(sub, STATE_ATTR):
            where = f"its submodule {name!r}" if name else "it"
            raise ValueError(
                f"{type(model).__name__} is already sharded ({where} went through fs.shard); "
                "call fs.shard once, on the root module, with a policy for the inner units"
            )


def _timeout(timeout_s: float | None) -> datetime.timedelta:
    seconds = (
        timeout_s
        if timeout_s is not None
        else float(os.environ.get("FLATSHARD_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    )
    if seconds <= 0:
        raise ValueError(f"timeout_s={seconds!r} must be positive (seconds to wait on a peer)")
    return datetime.timedelta(seconds=seconds)
