"""One transformer block (pre-norm attention + MLP): the unit an FSDP wrap policy wraps."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from flatshard.models.config import GPTConfig
from flatshard.models.rope import apply_rotary

__all__ = ["MLP", "Attention", "Block", "make_norm"]


def make_norm(config: GPTConfig) -> nn.Module:
    """The configured normalisation layer over ``d_model`` (weight only, no bias)."""
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.d_model, eps=config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=False)


class Attention(nn.Module):
    """Causal self-attention with RoPE and optional grouped-query attention.

    Padded batches (``cu_seqlens=None``) use ``F.scaled_dot_product_attention``; packed batches use
    :func:`flatshard.packing.varlen_attention`, causal within each document. ``n_heads`` and
    ``n_kv_heads`` are the model's counts; a tensor-parallel rank holds a share of them
    (:mod:`flatshard.models.tensor_parallel`), so shapes are read from the tensors instead.
    Under context parallelism (:mod:`flatshard.models.context_parallel`, set by its ``attach``)
    ``x`` holds this rank's share of each row and attention spans the cp group.
    """

    context_parallel = None  # a ContextParallel once attached; used while it is active

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.n_heads,
            config.kv_heads,
            config.head_dim,
        )
        d, kv_width = config.d_model, config.kv_heads * config.head_dim
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv_width, bias=False)
        self.v_proj = nn.Linear(d, kv_width, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        """``x [B, T, C]`` -> ``[B, T, C]``; ``cos``/``sin`` ``[B|1, T, 1, D/2]`` (from RoPE)."""
        # Head counts come from the projections' outputs, never from n_heads: under tensor
        # parallelism (models/tensor_parallel.py) q/k/v hold only this rank's heads.
        B, T, _ = x.shape
        D = self.head_dim
        q = self.q_proj(x).view(B, T, -1, D)  # [B, T, H, D]
        k = self.k_proj(x).view(B, T, -1, D)  # [B, T, KV, D]
        v = self.v_proj(x).view(B, T, -1, D)  # [B, T, KV, D]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)  # [B, T, H|KV, D]
        cp = self.context_parallel
        if cp is not None and cp.active:  # T is this cp rank's share of the row
            y = cp.attend(q, k, v)  # [B, T, H, D]
        elif cu_seqlens is None:
            y = F.scaled_dot_product_attention(
                q.transpose(1, 2),  # [B, H, T, D]
                k.transpose(1, 2),  # [B, KV, T, D]
                v.transpose(1, 2),  # [B, KV, T, D]
                is_causal=True,
                enable_gqa=k.shape[2] != q.shape[2],
            )  # [B, H, T, D]
            y = y.transpose(1, 2)  # [B, T, H, D]
        else:
            y = self._varlen(q, k, v, cu_seqlens, max_seqlen)  # [B, T, H, D]
        y = y.reshape(B, T, -1)  # [B, T, H*D]  (= C unless tensor-parallel)
        return self.o_proj(y)  # [B, T, C]

    def _varlen(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int | None,
    ) -> torch.Tensor:
        """Packed attention over the flattened ``B*T`` tokens, causal per document."""
        # Imported here so the model works (padded batches) even without the packing package.
        from flatshard.packing import varlen_attention

        B, T, H, D = q.shape
        KV = k.shape[2]  # varlen_attention handles grouped-query heads itself
        if max_seqlen is None:  # a host sync; GPT.forward computes it once for all layers
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        y = varlen_attention(
            q.reshape(B * T, H, D),  # [N, H, D]
            k.reshape(B * T, KV, D),  # [N, KV, D]
            v.reshape(B * T, KV, D),  # [N, KV, D]
            cu_seqlens,
            max_seqlen,
            causal=True,
        )  # [N, H, D]
        return y.reshape(B, T, H, D)  # [B, T, H, D]

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float) -> None:
        """Normal init: ``std`` for q/k/v, ``out_std`` for the residual output projection."""
        for lin in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.normal_(lin.weight, mean=0.0, std=std)
        nn.init.normal_(self.o_proj.weight, mean=0.0, std=out_std)


class MLP(nn.Module):
    """SwiGLU (``down(silu(gate(x)) * up(x))``) or GELU (``down(gelu(up(x)))``) feed-forward."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d, ff = config.d_model, config.ffn_dim
        self.gate_proj = nn.Linear(d, ff, bias=False) if config.mlp == "swiglu" else None
        self.up_proj = nn.Linear(d, ff, bias=False)
        self.down_proj = nn.Linear(ff, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, C]`` -> ``[B, T, C]``."""
        if self.gate_proj is None:
            h = F.gelu(self.up_proj(x), approximate="tanh")  # [B, T, F]
        else:
            h = F.silu(self.gate_proj(x)) * self.up_proj(x)  # [B, T, F]
        return self.down_proj(h)  # [B, T, C]

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float) -> None:
        """Normal init: ``std`` for the input projections, ``out_std`` for ``down_proj``."""
        for lin in (self.gate_proj, self.up_proj):
            if lin is not None:
                nn.init.normal_(lin.weight, mean=0.0, std=std)
        nn.init.normal_(self.down_proj.weight, mean=0.0, std=out_std)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.attn_norm = make_norm(config)
        self.attn = Attention(config)
        self.mlp_norm = make_norm(config)
        self.mlp = MLP(config)
        self.drop = nn.Dropout(config.dropout)
        if not self.attn_norm.weight.is_meta:  # on meta, the owner calls reset_parameters later
            self.reset_parameters()

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        """``x [B, T, C]`` -> ``[B, T, C]`` (see :meth:`Attention.forward` for the rest)."""
        h = self.attn(self.attn_norm(x), cos, sin, cu_seqlens, max_seqlen)  # [B, T, C]
        x = x + self.drop(h)  # [B, T, C]
        h = self.mlp(self.mlp_norm(x))  # [B, T, C]
        return x + self.drop(h)  # [B, T, C]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-initialise in place from the torch RNG (GPT-2 scheme, see ``GPTConfig.init_std``)."""
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.n_layers)
        self.attn_norm.reset_parameters()
        self.attn.reset_parameters(std, out_std)
        self.mlp_norm.reset_parameters()
        self.mlp.reset_parameters(std, out_std)
