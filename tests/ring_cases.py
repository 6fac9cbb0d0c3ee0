"""Ring attention alone against one process's attention over the whole row.

Every cp rank builds the same random row (seeded): queries, keys and values for all ``T``
tokens and the documents (several per row, and a padding tail of document ``-1``). Each rank
keeps its head-tail share, runs :func:`flatshard.models.ring_attention.ring_attention`, and
back-propagates a fixed random output gradient. The reference is SDPA over the whole row with
the causal, per-document mask, in float64; the rank compares its own tokens' outputs and
its own tokens' query, key and value gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from flatshard.models.context_parallel import ContextParallel, split_rows


def _row(T: int, heads: int, kv_heads: int, dim: int):
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, heads, T, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(2, kv_heads, T, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(2, kv_heads, T, dim, generator=gen, dtype=torch.float64)
    grad = torch.randn(2, heads, T, dim, generator=gen, dtype=torch.float64)
    docs = torch.tensor([[0] * 5 + [1] * (T - 8) + [-1] * 3, [0] * (T - 2) + [1, 1]])
    return q, k, v, grad, docs


def _reference(q, k, v, grad, docs):
    """Whole-row attention (float64) and its gradients."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    T = q.shape[2]
    pos = torch.arange(T)
    mask = (pos[None, :] <= pos[:, None]) & (docs[:, :, None] == docs[:, None, :])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def case_ring_matches_whole_row(dtype_name: str, T: int = 24) -> dict:
    dtype = getattr(torch, dtype_name)
    cp, rank = dist.get_world_size(), dist.get_rank()
    q, k, v, grad, docs = _row(T, heads=4, kv_heads=2, dim=8)
    want = _reference(q, k, v, grad, docs)
    context = ContextParallel(dist.group.WORLD, "ring")

    def mine(t):  # [B, H, T, D] -> this rank's [B, H, t, D]
        return split_rows(t.transpose(1, 2), cp, rank).transpose(1, 2)

    local = [mine(t).to(dtype).requires_grad_() for t in (q, k, v)]
    with context.attending(split_rows(docs, cp, rank)):
        out = context.attend(*(t.transpose(1, 2) for t in local)).transpose(1, 2)
    out.backward(mine(grad).to(dtype))
    got = [out.detach(), *(t.grad for t in local)]
    errors = {}
    for name, g, w in zip(("out", "grad_q", "grad_k", "grad_v"), got, want, strict=True):
        assert g.dtype == dtype, (name, g.dtype)
        w = mine(w)
        errors[name] = float((g.double() - w).abs().max() / w.abs().max())
    return errors
