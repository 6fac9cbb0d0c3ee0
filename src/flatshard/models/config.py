"""``GPTConfig``: the reference GPT's hyper-parameters, its validation and named presets."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["PRESETS", "GPTConfig"]

_NORMS = ("rmsnorm", "layernorm")
_MLPS = ("swiglu", "gelu")


@dataclass(frozen=True)
class GPTConfig:
    """Shape and initialisation of :class:`flatshard.models.GPT` (a Llama-style decoder)."""

    vocab_size: int = 258
    """Number of token ids; 258 = the byte tokenizer's 256 bytes + eos + pad."""
    d_model: int = 128
    """Width of the residual stream (embedding size)."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention (query) heads; must divide ``d_model``. Head size is ``d_model // n_heads``."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; must divide ``n_heads``.
    ``None`` = ``n_heads`` (plain multi-head attention)."""
    d_ff: int | None = None
    """Hidden width of the MLP. ``None`` = 4·d_model for gelu, and for swiglu 8/3·d_model rounded up
    to a multiple of 64 (same parameter count as a 4x gelu MLP, matmul-friendly)."""
    max_seq_len: int = 256
    """Longest sequence (or packed document) the RoPE tables cover; positions must be below it."""
    norm: str = "rmsnorm"
    """Normalisation layer: ``"rmsnorm"`` or ``"layernorm"`` (no bias either way)."""
    mlp: str = "swiglu"
    """MLP type: ``"swiglu"`` (Llama: gate, up and down projections) or ``"gelu"`` (GPT-2: up,
    down)."""
    rope_theta: float = 10000.0
    """RoPE base frequency; larger values suit longer contexts (Llama 3 uses 500000)."""
    tie_embeddings: bool = True
    """Share one matrix between the token embedding and the output head (``lm_head.weight is
    tok_emb.weight``)."""
    dropout: float = 0.0
    """Dropout on the embeddings and on each residual branch; 0 disables it (the usual for
    pre-training). There is no attention-probability dropout (varlen kernels do not offer it)."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation; residual output projections use
    ``init_std / sqrt(2 * n_layers)`` (GPT-2's scaling)."""
    norm_eps: float = 1e-5
    """Epsilon of the normalisation layers."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            _check_positive_int(name, getattr(self, name))
        for name in ("n_kv_heads", "d_ff"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                f"choose n_heads among the divisors of d_model, e.g. {_divisor_near(self)}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head size d_model/n_heads={self.head_dim} is odd, but RoPE rotates pairs of "
                "dimensions; choose d_model and n_heads so that d_model // n_heads is even"
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}; use a "
                "divisor of n_heads (or None for plain multi-head attention)"
            )
        _check_choice("norm", self.norm, _NORMS)
        _check_choice("mlp", self.mlp, _MLPS)
        _check_float("rope_theta", self.rope_theta, low=0.0, low_open=True)
        _check_float("dropout", self.dropout, low=0.0, high=1.0)
        _check_float("init_std", self.init_std, low=0.0, low_open=True)
        _check_float("norm_eps", self.norm_eps, low=0.0, low_open=True)
        if not isinstance(self.tie_embeddings, bool):
            raise TypeError(f"tie_embeddings={self.tie_embeddings!r} must be True or False")

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads (``n_kv_heads`` resolved)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_dim(self) -> int:
        """MLP hidden width (``d_ff`` resolved)."""
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp == "gelu":
            return 4 * self.d_model
        return 64 * math.ceil(8 * self.d_model / 3 / 64)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """The named preset from :data:`PRESETS`, with any fields replaced by ``overrides``."""
        if name not in PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; choose one of {', '.join(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    def num_params(self, *, exclude_embeddings: bool = False) -> int:
        """Parameter count of the model this config builds (tied weights counted once).

        Computed from the config, so it is right before the model exists and after it is sharded.
        ``exclude_embeddings`` leaves out the token embedding and an untied output head (Kaplan et
        al.'s "non-embedding parameters").
        """
        d, kv_width = self.d_model, self.kv_heads * self.head_dim
        attn = 2 * d * d + 2 * d * kv_width  # q, o: d->d; k, v: d->kv_width
        mlp = (3 if self.mlp == "swiglu" else 2) * d * self.ffn_dim
        body = self.n_layers * (attn + mlp + 2 * d) + d  # + two norms per block, + the final norm
        if exclude_embeddings:
            return body
        heads = 1 if self.tie_embeddings else 2
        return body + heads * self.vocab_size * d

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward), as in PaLM's MFU formula.

        ``6 * N + 12 * n_layers * n_heads * head_dim * seq_len``, where N counts the non-embedding
        parameters plus the output head (its matmul costs FLOPs even when tied; the embedding lookup
        costs none). The attention term has no causal discount (PaLM's convention). For packed
        batches pass the typical document length, not the packed length, for an honest figure.
        """
        _check_positive_int("seq_len", seq_len)
        n = self.num_params(exclude_embeddings=True) + self.vocab_size * self.d_model
        return 6 * n + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name}={value} must be positive")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; use one of {', '.join(choices)}")


def _check_float(
    name: str, value: float, *, low: float, high: float = math.inf, low_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={value!r} must be a number")
    too_low = value <= low if low_open else value < low
    if too_low or not value < high or math.isnan(value):
        bracket = "(" if low_open else "["
        raise ValueError(
            f"{name}={value!r} is out of range; use a value in {bracket}{low}, {high})"
        )


def _divisor_near(cfg: GPTConfig) -> int:
    """The divisor of ``d_model`` closest to the requested ``n_heads``, for the error message."""
    divisors = [h for h in range(1, cfg.d_model + 1) if cfg.d_model % h == 0]
    return min(divisors, key=lambda h: (abs(h - cfg.n_heads), h))


PRESETS: dict[str, GPTConfig] = {
    # CPU demo: trains visibly on bytes within a minute or two on two cores.
    "tiny": GPTConfig(d_model=128, n_layers=4, n_heads=4, max_seq_len=256),
    # A bigger CPU run / a quick GPU run.
    "small": GPTConfig(d_model=384, n_layers=6, n_heads=6, max_seq_len=512),
    # GPT-2-small-sized body, GPU.
    "medium": GPTConfig(d_model=768, n_layers=12, n_heads=12, max_seq_len=1024),
    # GPU, grouped-query attention from here on.
    "large": GPTConfig(d_model=1024, n_layers=24, n_heads=16, n_kv_heads=8, max_seq_len=2048),
    # Llama-3.2-1B-shaped body (with a byte vocabulary), GPU.
    "1b": GPTConfig(
        d_model=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        d_ff=8192,
        max_seq_len=2048,
        rope_theta=500000.0,
    ),
}
"""Named configurations, smallest first; see ``docs/data_and_model.md`` for their sizes."""
