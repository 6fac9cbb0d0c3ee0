"""What the estimator is asked about: the model, the layout and the workload.

Frozen dataclasses, validated on construction, no torch needed. Sizes are element counts;
byte widths come from :class:`Precision`.
"""

from __future__ import annotations

from dataclasses import dataclass

from flatshard.core.layout import padded_numel

__all__ = ["STRATEGIES", "Layout", "ModelSpec", "Precision", "Workload"]

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
    norm: str = "rmsnorm"
    """``"rmsnorm"`` or ``"layernorm"`` (weight only, no bias, as in ``GPTConfig``)."""
    head_dim: int | None = None
    """Width of one attention head; ``None``: ``hidden // heads``. Set explicitly by
    ``tensor_parallel.local_spec``, whose spec holds one TP rank's share of the heads."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "vocab", "ffn", "max_seq"):
            _positive(name, getattr(self, name))
        if self.head_dim is not None:
            _positive("head_dim", self.head_dim)
        if (self.head_dim is None and self.hidden % self.heads) or self.heads % self.kv_heads:
            raise ValueError(
                f"heads={self.heads} must divide hidden={self.hidden} and kv_heads="
                f"{self.kv_heads} must divide heads; check --heads/--kv-heads"
            )
        if self.mlp not in ("swiglu", "gelu") or self.norm not in ("rmsnorm", "layernorm"):
            raise ValueError(
                f"mlp={self.mlp!r}, norm={self.norm!r}: use swiglu/gelu and rmsnorm/layernorm"
            )

    @property
    def head_size(self) -> int:
        """Width of one attention head."""
        return self.head_dim or self.hidden // self.heads

    @property
    def q_width(self) -> int:
        """Width of the query projection output (``hidden`` unless TP-local)."""
        return self.heads * self.head_size

    @property
    def kv_width(self) -> int:
        """Width of the key (and value) projection output."""
        return self.kv_heads * self.head_size

    @property
    def block_params(self) -> int:
        """Parameters of one block: q, k, v, o projections, the MLP and two norm weights."""
        return sum(self.block_sizes)

    @property
    def block_sizes(self) -> list[int]:
        """Parameter sizes of one block in registration order (= its flat layout)."""
        c, q, kv, f = self.hidden, self.q_width, self.kv_width, self.ffn
        mlp = [c * f] * (3 if self.mlp == "swiglu" else 2)
        return [c, c * q, c * kv, c * kv, q * c, c, *mlp]

    @property
    def root_sizes(self) -> list[int]:
        """Root unit parameter sizes in order: embedding, final norm, (untied) head."""
        return [self.vocab * self.hidden, self.hidden] + [self.vocab * self.hidden] * (
            not self.tied
        )

    @property
    def block_tensors(self) -> int:
        """Parameter tensors per block (each gets a 4-byte AdamW ``step``)."""
        return len(self.block_sizes)

    @property
    def root_params(self) -> int:
        """Embedding, final norm weight and (untied) output head."""
        return sum(self.root_sizes)

    @property
    def root_tensors(self) -> int:
        return len(self.root_sizes)

    @property
    def params(self) -> int:
        """All parameters, tied weights counted once (= ``GPTConfig.num_params()``)."""
        return self.root_params + self.layers * self.block_params

    def flops_per_token(self, seq: int) -> int:
        """Training FLOPs per token, PaLM's formula as in ``GPTConfig.flops_per_token``."""
        n = self.layers * self.block_params + self.hidden + self.vocab * self.hidden
        return 6 * n + 12 * self.layers * self.q_width * seq

    @classmethod
    def from_preset(cls, name: str) -> ModelSpec:
        """The spec of ``flatshard.models.PRESETS[name]`` (exact parameter count)."""
        from flatshard.models.config import PRESETS

        if name not in PRESETS:
            raise ValueError(f"--model {name!r} is unknown; choose one of {', '.join(PRESETS)}")
        c = PRESETS[name]
        return cls(name, c.n_layers, c.d_model, c.n_heads, c.kv_heads, c.vocab_size, c.ffn_dim,
                   c.tie_embeddings, c.mlp, c.max_seq_len, c.norm)  # fmt: skip

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
    """Byte widths. ``fp32``: everything fp32. ``bf16``: ``fs.MixedPrecision(param_dtype=bf16)``
    — sharded fp32 master weights and fp32 ``.grad``, bf16 gathered parameters, activations and
    (by default) gradient reduction."""

    name: str = "fp32"
    """Compute dtype: ``"fp32"`` or ``"bf16"``."""
    reduce: str | None = None
    """dtype of the flat gradients that are reduced: ``"fp32"``, ``"bf16"``, or ``None`` for
    the compute dtype (flatshard's default)."""

    def __post_init__(self) -> None:
        for field_, value in (("dtype", self.name), ("reduce dtype", self.reduce or "fp32")):
            if value not in ("fp32", "bf16"):
                raise ValueError(f"{field_} {value!r} is not supported; use fp32 or bf16")

    master = 4  # sharded parameter storage (the optimizer's copy)
    grad = 4  # .grad of the fragments (what the optimizer reads)

    @property
    def param(self) -> int:
        """Gathered (compute) parameter and per-parameter autograd gradient bytes."""
        return 4 if self.name == "fp32" else 2

    @property
    def act(self) -> int:
        return self.param

    @property
    def flat(self) -> int:
        """Flat gradient and gradient-shard bytes (the reduce dtype)."""
        return 4 if (self.reduce or self.name) == "fp32" else 2


@dataclass(frozen=True)
class Layout:
    """How the model is spread over ranks."""

    world: int
    """Data-parallel ranks (the data-parallel degree; with ``tp > 1`` each is a TP group)."""
    strategy: str = "full_shard"
    """One of :data:`STRATEGIES`."""
    shard_size: int | None = None
    """hybrid_shard: ranks per shard group (default: min(world, 8)); ignored otherwise."""
    precision: Precision = Precision()
    """Byte widths."""
    optimizer: str = "adamw"
    """``adamw`` (m, v: 8 bytes/param), ``sgdm`` (momentum: 4), ``sgd`` (0)."""
    optimizer_impl: str = "foreach"
    """torch.optim implementation: ``foreach`` (GPU default; AdamW's sqrt(v) for the whole
    shard at once), ``forloop`` (CPU default; per tensor) or ``fused`` (no temporary)."""
    max_inflight_reduces: int = 2
    """flatshard waits for the oldest reduce-scatter beyond this many (engine default 2)."""
    prefetch_forward: int = 1
    """Units gathered ahead in forward (``fs.Prefetch(forward=...)``); each holds memory."""
    prefetch_backward: str = "pre"
    """``fs.Prefetch(backward=...)``: ``pre`` gathers the next unit (a bucket counts as one) as
    a unit's backward starts, ``post`` after it finished, ``none`` when its backward starts."""
    backend: str = "nccl"
    """``nccl`` or ``gloo``. On Gloo groups of more than 8 ranks flatshard reduce-scatters as an
    in-place all-reduce of the flat gradient (faster there), which moves twice the bus bytes;
    up to 8 it uses a point-to-point ring (``gloo_p2p``), the same bytes as NCCL's."""
    coalesce: bool = True
    """``fs.shard(coalesce=...)``: ``True`` is ``fs.Coalesce()`` (blocks of at most 2 MiB
    gathered share collectives, in buckets of at most 8 MiB); ``False`` gathers and reduces
    every unit alone."""
    split_root: bool = True
    """``fs.shard(split_root=...)``: the final norm and an untied head are a unit of their own
    (the root's tail), and under full_shard/hybrid_shard the rest of the root is released after
    forward (see [Note: the estimator's units] in ``units.py``)."""
    tp: int = 1
    """Tensor-parallel degree (torchtitan's Llama plan, see ``tp_cost.py``): each of
    ``world`` data-parallel ranks is a group of ``tp`` GPUs, ``world * tp`` GPUs in all."""
    sequence_parallel: bool = True
    """With ``tp > 1``: norms and the residual stream sharded over the sequence (torchtitan's
    plan: all-gather / reduce-scatter around each block half) instead of replicated
    (all-reduce)."""
    async_tp: bool = False
    """With ``tp > 1``: torchtitan's async TP (collective matmuls) hides the TP collectives
    under the matmuls they feed (``efficiency.py``)."""
    cp: int = 1
    """Context-parallel degree (``cp_cost.py``): each data-parallel rank's sequences are split
    over ``cp`` GPUs (head-tail load balanced), and the parameters are sharded over the
    flattened ``world x cp`` mesh; ``world * cp * tp`` GPUs in all."""

    def __post_init__(self) -> None:
        _positive("world", self.world)
        _positive("tp", self.tp)
        _positive("cp", self.cp)
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} is unknown; use one of {STRATEGIES}")
        if self.prefetch_forward < 0 or self.prefetch_backward not in ("pre", "post", "none"):
            raise ValueError(
                f"prefetch_forward={self.prefetch_forward} must be >= 0 and prefetch_backward="
                f"{self.prefetch_backward!r} one of 'pre', 'post', 'none'"
            )
        if self.optimizer_impl not in ("foreach", "forloop", "fused"):
            raise ValueError(f"optimizer_impl={self.optimizer_impl!r}; use foreach/forloop/fused")
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend={self.backend!r}; use 'nccl' or 'gloo'")
        if self.optimizer not in OPTIMIZER_BYTES:
            raise ValueError(f"optimizer={self.optimizer!r}; use one of {list(OPTIMIZER_BYTES)}")
        if self.shard_size is not None and (self.shard_size <= 0 or self.world % self.shard_size):
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
    def gpus(self) -> int:
        """Ranks in all: ``world`` data-parallel ranks of ``cp x tp`` GPUs each."""
        return self.world * self.cp * self.tp

    @property
    def optimizer_bytes(self) -> int:
        return OPTIMIZER_BYTES[self.optimizer]

    def padded(self, numel: int) -> int:
        """A unit's flat size: padded so that each rank's chunk is a multiple of 16 bytes, as
        ``engine.layout`` pads it (the 16-byte gaps between parameters are left out: < 16 B
        each)."""
        return padded_numel(numel, self.shard_world, 16 // self.precision.param)


@dataclass(frozen=True)
class Workload:
    """One micro-batch per data-parallel rank (its TP group shares it)."""

    batch: int = 1
    """Sequences per data-parallel rank."""
    seq: int = 2048
    """Tokens per sequence."""
    act_ckpt: bool = False
    """Activation checkpointing of every block (only its input is kept)."""
    attention: str = "flash"
    """``flash`` (no T x T matrix stored: SDPA flash/efficient kernels, varlen) or ``math``."""
    fused_norm: bool = False
    """RMSNorm as one kernel (saves input and rstd) instead of PyTorch's composite RMSNorm on
    CPU (which also saves ``x * rstd``). LayerNorm is always one kernel (input, mean, rstd)."""
    selective_ac: bool = False
    """torchtitan's per-op selective activation checkpointing: a block keeps its input, the
    outputs of every second matmul (wq, wv, w1, w2) and attention's; it recomputes the rest
    (wk, wo, w3 and the elementwise ops). Exclusive with ``act_ckpt``."""
    compile: bool = False
    """Blocks under ``torch.compile`` (time only, ``efficiency.py``)."""
    float8: bool = False
    """Float8 block linears (torchao, tensorwise scaling; time only, ``efficiency.py``)."""

    def __post_init__(self) -> None:
        _positive("batch", self.batch)
        _positive("seq", self.seq)
        if self.attention not in ("flash", "math"):
            raise ValueError(f"attention={self.attention!r}; use 'flash' or 'math'")
        if self.act_ckpt and self.selective_ac:
            raise ValueError("act_ckpt (full) and selective_ac exclude each other; pick one")

    @property
    def tokens(self) -> int:
        return self.batch * self.seq
