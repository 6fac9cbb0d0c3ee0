"""What the estimator is asked about: the model, the layout, the workload and the hardware.

Frozen dataclasses, validated on construction, no torch needed. Sizes are element counts;
byte widths come from :class:`Precision`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DEVICES", "STRATEGIES", "Device", "Layout", "ModelSpec", "Precision", "Workload"]

STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")
OPTIMIZER_BYTES = {"adamw": 8, "sgdm": 4, "sgd": 0}  # fp32 state bytes per parameter element


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer shaped like :class:`flatshard.models.GPT` (Llama-style)."""

    name: str
    """Label for reports (a preset name, or "custom")."""
    layers: int
    """Transformer blocks; each is one flatshard unit, the rest (embeddings, head, final norm)
    is the root unit."""
    hidden: int
    """Width of the residual stream (d_model)."""
    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads (grouped-query attention when below ``heads``)."""
    vocab: int
    """Vocabulary size."""
    ffn: int
    """MLP hidden width."""
    tied: bool = False
    """Output head shares the embedding matrix."""
    mlp: str = "swiglu"
    """``"swiglu"`` (gate, up, down) or ``"gelu"`` (up, down)."""
    max_seq: int = 2048
    """Length of the RoPE tables (fp32 buffers, replicated on every rank)."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "vocab", "ffn", "max_seq"):
            _positive(name, getattr(self, name))
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"heads={self.heads} must divide hidden={self.hidden} and kv_heads="
                f"{self.kv_heads} must divide heads; check --heads/--kv-heads"
            )
        if self.mlp not in ("swiglu", "gelu"):
            raise ValueError(f"mlp={self.mlp!r} is not supported; use 'swiglu' or 'gelu'")

    @property
    def kv_width(self) -> int:
        """Width of the key (and value) projection output."""
        return self.kv_heads * (self.hidden // self.heads)

    @property
    def block_params(self) -> int:
        """Parameters of one block: q, k, v, o projections, the MLP and two norm weights."""
        c = self.hidden
        mats = 3 if self.mlp == "swiglu" else 2
        return 2 * c * c + 2 * c * self.kv_width + mats * c * self.ffn + 2 * c

    @property
    def block_tensors(self) -> int:
        """Parameter tensors per block (each gets a 4-byte AdamW ``step``)."""
        return 9 if self.mlp == "swiglu" else 8

    @property
    def root_params(self) -> int:
        """Embedding, final norm weight and (untied) output head."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def root_tensors(self) -> int:
        return 2 if self.tied else 3

    @property
    def params(self) -> int:
        """All parameters, tied weights counted once (= ``GPTConfig.num_params()``)."""
        return self.root_params + self.layers * self.block_params

    def flops_per_token(self, seq: int) -> int:
        """Training FLOPs per token, PaLM's formula as in ``GPTConfig.flops_per_token``."""
        n = self.layers * self.block_params + self.hidden + self.vocab * self.hidden
        return 6 * n + 12 * self.layers * self.hidden * seq

    @classmethod
    def from_preset(cls, name: str) -> ModelSpec:
        """The spec of ``flatshard.models.PRESETS[name]`` (exact parameter count)."""
        from flatshard.models.config import PRESETS

        if name not in PRESETS:
            raise ValueError(f"--model {name!r} is unknown; choose one of {', '.join(PRESETS)}")
        c = PRESETS[name]
        return cls(name, c.n_layers, c.d_model, c.n_heads, c.kv_heads, c.vocab_size, c.ffn_dim,
                   c.tie_embeddings, c.mlp, c.max_seq_len)  # fmt: skip

    @classmethod
    def from_sizes(
        cls,
        *,
        layers: int,
        hidden: int,
        heads: int,
        vocab: int,
        kv_heads: int | None = None,
        ffn: int | None = None,
        params: float | None = None,
        **kw: object,
    ) -> ModelSpec:
        """A spec from explicit sizes. Without ``ffn`` it is solved from ``params``; with both,
        they must agree within 2% (the structure wins)."""
        kv = kv_heads or heads
        if ffn is None:
            if params is None:
                raise ValueError("give --ffn or --params (the MLP width is solved from it)")
            probe = cls("custom", layers, hidden, heads, kv, vocab, 1, **kw)  # type: ignore[arg-type]
            per_ffn_unit = (3 if probe.mlp == "swiglu" else 2) * hidden
            rest = probe.root_params + layers * (probe.block_params - per_ffn_unit)
            ffn = round((params - rest) / (layers * per_ffn_unit))
            if ffn <= 0:
                raise ValueError(
                    f"--params {params:.4g} is too small for {layers} layers of width {hidden} "
                    f"and a {vocab}-token vocabulary; raise --params or give --ffn"
                )
        spec = cls("custom", layers, hidden, heads, kv, vocab, ffn, **kw)  # type: ignore[arg-type]
        if params is not None and abs(spec.params - params) > 0.02 * params:
            raise ValueError(
                f"--params {params:.4g} disagrees with the sizes given ({spec.params:.4g} "
                "parameters); drop --params or --ffn"
            )
        return spec


@dataclass(frozen=True)
class Precision:
    """Byte widths. ``fp32``: everything fp32. ``bf16``: mixed precision with sharded fp32 master
    weights, bf16 gathered parameters and activations, ``reduce`` bytes on the wire."""

    name: str = "fp32"
    """``"fp32"`` or ``"bf16"``."""
    reduce: str = "fp32"
    """dtype of the flat gradients that are reduce-scattered: ``"fp32"`` or ``"bf16"``."""

    def __post_init__(self) -> None:
        for field_, value in (("dtype", self.name), ("reduce dtype", self.reduce)):
            if value not in ("fp32", "bf16"):
                raise ValueError(f"{field_} {value!r} is not supported; use fp32 or bf16")

    master = 4  # sharded parameter storage (the optimizer's copy)
    grad = 4  # sharded gradient (what the optimizer reads)
    logits = 4  # the loss is computed in fp32 (GPT.loss)

    @property
    def param(self) -> int:
        """Gathered (compute) parameter and per-parameter autograd gradient bytes."""
        return 4 if self.name == "fp32" else 2

    @property
    def act(self) -> int:
        return self.param

    @property
    def flat(self) -> int:
        return 4 if self.reduce == "fp32" else 2


@dataclass(frozen=True)
class Layout:
    """How the model is spread over ranks."""

    world: int
    """Data-parallel ranks."""
    strategy: str = "full_shard"
    """One of :data:`STRATEGIES`."""
    shard_size: int | None = None
    """hybrid_shard: ranks per shard group (default: min(world, 8)); ignored otherwise."""
    precision: Precision = Precision()
    """Byte widths."""
    optimizer: str = "adamw"
    """``adamw`` (m, v: 8 bytes/param), ``sgdm`` (momentum: 4), ``sgd`` (0)."""
    max_inflight_reduces: int = 2
    """flatshard waits for the oldest reduce-scatter beyond this many (engine default 2)."""
    backend: str = "nccl"
    """``nccl`` or ``gloo``. Gloo's reduce-scatter copies its whole input into a temporary of
    the same size when it is waited on; NCCL reduces in place."""

    def __post_init__(self) -> None:
        _positive("world", self.world)
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} is unknown; use one of {STRATEGIES}")
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend={self.backend!r}; use 'nccl' or 'gloo'")
        if self.optimizer not in OPTIMIZER_BYTES:
            raise ValueError(f"optimizer={self.optimizer!r}; use one of {list(OPTIMIZER_BYTES)}")
        if self.shard_size is not None and (
            self.shard_size <= 0 or self.world % self.shard_size
        ):
            raise ValueError(
                f"shard_size={self.shard_size} must divide world={self.world} (hybrid_shard)"
            )

    @property
    def shard_world(self) -> int:
        """Ranks one parameter is split over."""
        if self.strategy == "no_shard":
            return 1
        if self.strategy == "hybrid_shard":
            return self.shard_size or min(self.world, 8)
        return self.world

    @property
    def optimizer_bytes(self) -> int:
        return OPTIMIZER_BYTES[self.optimizer]

    def padded(self, numel: int) -> int:
        """A unit's flat size: padded to a multiple of the shard group (at least one each)."""
        w = self.shard_world
        return max(w, math.ceil(numel / w) * w)


@dataclass(frozen=True)
class Workload:
    """One micro-batch per rank."""

    batch: int = 1
    """Sequences per rank."""
    seq: int = 2048
    """Tokens per sequence."""
    act_ckpt: bool = False
    """Activation checkpointing of every block (only its input is kept)."""
    attention: str = "flash"
    """``flash`` (no T x T matrix stored: SDPA flash/efficient kernels, varlen) or ``math``."""
    fused_norm: bool = False
    """RMSNorm as one kernel (saves input + rstd) instead of PyTorch's composite on CPU."""

    def __post_init__(self) -> None:
        _positive("batch", self.batch)
        _positive("seq", self.seq)
        if self.attention not in ("flash", "math"):
            raise ValueError(f"attention={self.attention!r}; use 'flash' or 'math'")

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


@dataclass(frozen=True)
class Device:
    """Peak dense FLOP/s, collective bus bandwidth and memory of one accelerator."""

    name: str
    flops: dict[str, float]
    """Peak dense FLOP/s by compute dtype (``fp32`` without TF32, ``bf16``)."""
    intra_gbps: float
    """Bus bandwidth (GB/s, nccl-tests' busbw) within a node."""
    inter_gbps: float
    """Bus bandwidth (GB/s) per rank when a collective spans nodes."""
    per_node: int
    """Ranks per node."""
    memory_gib: float | None
    """Usable memory per rank; ``None``: no fit check."""
    mfu: float = 0.4
    """Default model FLOPs utilisation."""


DEVICES: dict[str, Device] = {
    "h100": Device("h100", {"bf16": 989e12, "fp32": 67e12}, 360.0, 45.0, 8, 80.0),
    "h200": Device("h200", {"bf16": 989e12, "fp32": 67e12}, 360.0, 45.0, 8, 141.0),
    "a100": Device("a100", {"bf16": 312e12, "fp32": 19.5e12}, 230.0, 22.0, 8, 80.0),
    # This 2-core box, one core per rank, Gloo over loopback: rough, see docs/estimate.md.
    "cpu": Device("cpu", {"bf16": 2.3e11, "fp32": 1e11}, 0.35, 0.35, 64, None, mfu=0.5),
}
"""Defaults for ``--gpu``; every figure can be overridden on the command line."""
