"""Turning a :class:`TrainConfig` into concrete choices for this machine.

A config may say ``0`` or ``"auto"`` where the right value depends on the hardware or on other
fields (TOML has no null). :func:`resolve` replaces them, so that the ``config.toml`` written into
the output directory names what actually ran and reproduces it elsewhere.
"""

from __future__ import annotations

import dataclasses

import torch

import flatshard as fs
from flatshard.models import GPTConfig
from flatshard.tools.train.config import TrainConfig

__all__ = [
    "comm",
    "default_nproc",
    "gpt_config",
    "mixed_precision",
    "moe_config",
    "resolve",
    "torch_dtype",
]

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def default_nproc() -> int:
    """One worker per GPU, or 2 CPU workers (Gloo) when there is no GPU."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def _auto_param_dtype(cuda: bool) -> str:
    """bf16 where it is faster, else fp32.

    CUDA: when the device supports bf16. CPU: always (bf16 matmuls are ~2.3x fp32 on the CI box;
    a whole training step of the "small" GPT measured 1.91x, see docs/mixed_precision.md).
    The fp32 master shards and the fp32 gradient reduction keep the optimizer exact.
    """
    if cuda and not torch.cuda.is_bf16_supported():
        return "fp32"
    return "bf16"


def resolve(cfg: TrainConfig, *, cuda: bool, local_world: int) -> TrainConfig:
    """``cfg`` with every auto value made concrete for this run."""
    parallel = dataclasses.replace(
        cfg.parallel,
        nproc=cfg.parallel.nproc or local_world,
        backend=cfg.parallel.backend
        if cfg.parallel.backend != "auto"
        else ("nccl" if cuda else "gloo"),
    )
    precision = cfg.precision
    if precision.param_dtype == "auto":
        precision = dataclasses.replace(precision, param_dtype=_auto_param_dtype(cuda))
    optim = dataclasses.replace(cfg.optim, decay_steps=cfg.optim.decay_steps or cfg.steps)
    return dataclasses.replace(cfg, parallel=parallel, precision=precision, optim=optim)


def gpt_config(cfg: TrainConfig) -> GPTConfig:
    """The GPT shape: the preset, fields set to non-zero replaced, RoPE tables = seq_len."""
    m = cfg.model
    shape = {k: getattr(m, k) for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")}
    overrides = {k: v for k, v in shape.items() if v}
    return GPTConfig.preset(
        m.preset,
        **overrides,
        dropout=m.dropout,
        max_seq_len=cfg.data.seq_len,
        tie_embeddings=m.tie_embeddings,
    )


def moe_config(cfg: TrainConfig) -> object:
    """The Mixture-of-Experts shape (``model.experts > 0``): :func:`gpt_config`'s, every
    block's MLP made ``model.experts`` experts of width ``d_ff``, ``model.top_k`` routed."""
    import dataclasses as dc

    from flatshard.models.moe import MoEConfig

    dense = gpt_config(cfg)
    fields = {f.name: getattr(dense, f.name) for f in dc.fields(dense) if f.init}
    return MoEConfig(**fields, n_experts=cfg.model.experts, top_k=cfg.model.top_k)


def torch_dtype(name: str) -> torch.dtype:
    """``"bf16"`` -> ``torch.bfloat16`` etc."""
    return _TORCH_DTYPES[name]


def mixed_precision(cfg: TrainConfig) -> object | None:
    """The ``mixed_precision=`` argument of ``fs.shard`` for ``cfg.precision`` (None = fp32)."""
    p = cfg.precision
    if p.param_dtype == "fp32" and p.reduce_dtype == "fp32":
        return None
    return fs.MixedPrecision(
        param_dtype=torch_dtype(p.param_dtype),
        reduce_dtype=torch_dtype(p.reduce_dtype),
        output_dtype=torch.float32,  # the loss is computed in fp32
    )


def comm(cfg: TrainConfig) -> object | None:
    """The ``comm=`` argument of ``fs.shard`` for ``cfg.comm`` (None = the reduce-scatter and
    the all-gather in their dtypes)."""
    c = cfg.comm
    if c.error_feedback and c.reduce not in ("int8", "fp8"):
        raise ValueError(
            f"comm.error_feedback=true with comm.reduce={c.reduce!r}: error feedback corrects a "
            "quantized wire; pass --comm.reduce int8 or fp8, or --comm.error_feedback false"
        )
    if c.error_feedback and cfg.parallel.pp > 1:
        raise ValueError(
            f"comm.error_feedback=true with parallelism.pp={cfg.parallel.pp}: pipeline "
            "checkpoints cannot hold the residuals yet; pass --comm.error_feedback false"
        )
    gather = None if c.gather == "none" else c.gather
    if c.reduce == "fp32" and gather is None:
        return None
    reduce = None if c.reduce == "fp32" else c.reduce
    return fs.Comm(reduce=reduce, error_feedback=c.error_feedback, gather=gather)
