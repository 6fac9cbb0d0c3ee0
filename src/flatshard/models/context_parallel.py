"""Context parallelism for the reference GPT: every row's tokens split over ``cp`` ranks.

[Note: head-tail context parallelism]
A row of ``T`` tokens is cut into ``2 * cp`` chunks; cp rank ``r`` holds chunk ``r`` and chunk
``2 * cp - 1 - r`` (:func:`head_tail_indices`). Under causal attention a late chunk attends to
far more keys than an early one, so pairing the ``r``-th earliest with the ``r``-th latest gives
every rank the same attention work. Everything per token (embedding, MLP, norms, the loss) is
local; only attention crosses ranks:

* **Keys and values are all-gathered** over the cp group (:class:`_GatherKeys`, autograd-aware:
  the backward sums every rank's gradient for a key and hands each rank the part of its own
  keys), so each rank attends its ``T / cp`` queries to all ``T`` keys.
* **The causal mask comes from global positions**, not from local offsets: the gathered keys
  arrive in rank order (rank 0's two chunks, then rank 1's, ...), so key ``j`` sits at row
  position ``key_positions[j]`` and query ``i`` at ``head_tail_indices(...)[i]``; key ``j`` is
  visible to query ``i`` when its position is not later and it belongs to the same document
  (packed rows carry several; padding is a document of its own). This is the 1-D causal,
  per-document attention exactly, only computed in another order.
* **RoPE** uses the tokens' positions in their documents, sliced like the tokens (the caller
  passes them as ``position_ids``).

The extra memory is ``K`` and ``V`` of a whole row and one ``[T / cp, T]`` mask per rank; a ring
(one peer's keys at a time) would avoid the gather, at the price of ``cp`` rounds per layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# torch 2.13 renames all_gather_into_tensor (deprecated there); older torch has only that name
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = ["ContextParallel", "attach", "context_parallel_of", "head_tail_indices", "split_rows"]


def head_tail_indices(seq_len: int, cp: int, rank: int, device: torch.device | None = None):
    """Row positions (``[seq_len // cp]`` int64) that cp rank ``rank`` holds: chunks ``rank``
    and ``2 * cp - 1 - rank`` of ``seq_len`` cut into ``2 * cp`` (see the note above)."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"seq_len={seq_len} is not divisible by 2 * cp = {2 * cp}: head-tail context "
            f"parallelism cuts every row into 2 * cp equal chunks; use a multiple of {2 * cp}"
        )
    chunk = seq_len // (2 * cp)
    starts = (rank * chunk, (2 * cp - 1 - rank) * chunk)
    return torch.cat([torch.arange(s, s + chunk, device=device) for s in starts])


def split_rows(tensor: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This cp rank's tokens of ``tensor [rows, seq_len, ...]``: ``[rows, seq_len / cp, ...]``."""
    return tensor[:, head_tail_indices(tensor.shape[1], cp, rank, tensor.device)]


class _GatherKeys(torch.autograd.Function):
    """All-gather ``[B, t, ...]`` over ``group`` along dim 1 in rank order -> ``[B, cp * t, ...]``;
    the backward sums the ranks' gradients and returns this rank's slice (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.t = group, dist.get_rank(group), local.shape[1]
        size = dist.get_world_size(group)
        rows_first = local.movedim(1, 0).contiguous()  # [t, B, ...]: gather on the leading dim
        out = rows_first.new_empty((size * ctx.t, *rows_first.shape[1:]))  # [cp*t, B, ...]
        _all_gather(out, rows_first, group=group)
        return out.movedim(0, 1)  # [B, cp*t, ...]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.movedim(1, 0).contiguous()  # [cp*t, B, ...]
        if dist.get_backend(ctx.group) == "nccl":
            mine = grad.new_empty((ctx.t, *grad.shape[1:]))
            dist.reduce_scatter_tensor(mine, grad, group=ctx.group)
        else:  # gloo has no reduce-scatter: sum everything, keep this rank's keys
            dist.all_reduce(grad, group=ctx.group)
            mine = grad[ctx.rank * ctx.t : (ctx.rank + 1) * ctx.t]
        return mine.movedim(0, 1), None  # [B, t, ...]


class ContextParallel:
    """The attention of every block of one model over a cp group (see the note above).

    Inactive until :meth:`attending` sets the micro-batch's documents; inactive, the blocks run
    their ordinary full-sequence attention (e.g. for generation, every rank the whole context).
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.mask: torch.Tensor | None = None  # [B, 1, t, T] while attending

    @property
    def active(self) -> bool:
        return self.mask is not None

    @contextmanager
    def attending(self, document_ids: torch.Tensor) -> Iterator[None]:
        """Blocks attend across the cp group while inside; ``document_ids [B, t]`` are this
        rank's tokens' documents (head-tail split, ``-1`` padding), one small all-gather."""
        t = document_ids.shape[1]
        T, device = t * self.cp, document_ids.device
        q_pos = head_tail_indices(T, self.cp, self.rank, device)  # [t]
        k_pos = torch.cat([head_tail_indices(T, self.cp, r, device) for r in range(self.cp)])
        with torch.no_grad():
            k_doc = _GatherKeys.apply(document_ids, self.group)  # [B, T] in rank order
        causal = k_pos[None, :] <= q_pos[:, None]  # [t, T]
        same_doc = document_ids[:, :, None] == k_doc[:, None, :]  # [B, t, T]
        self.mask = (causal & same_doc).unsqueeze(1)  # [B, 1, t, T]
        try:
            yield
        finally:
            self.mask = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q [B, t, H, D]``, ``k``/``v [B, t, KV, D]`` (this rank's tokens, RoPE applied) ->
        ``[B, t, H, D]``: this rank's queries over the whole row's keys."""
        k_all = _GatherKeys.apply(k, self.group)  # [B, T, KV, D]
        v_all = _GatherKeys.apply(v, self.group)  # [B, T, KV, D]
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2),  # [B, H, t, D]
            k_all.transpose(1, 2),  # [B, KV, T, D]
            v_all.transpose(1, 2),  # [B, KV, T, D]
            attn_mask=self.mask,  # [B, 1, t, T]
            enable_gqa=k.shape[2] != q.shape[2],
        )  # [B, H, t, D]
        return y.transpose(1, 2)  # [B, t, H, D]


def attach(model: nn.Module, group: dist.ProcessGroup) -> ContextParallel:
    """Make every :class:`~flatshard.models.block.Attention` of ``model`` context-parallel over
    ``group`` (one shared :class:`ContextParallel`, returned). Call before ``fs.shard``."""
    from flatshard.models.block import Attention

    cp = ContextParallel(group)
    found = [m for m in model.modules() if isinstance(m, Attention)]
    if not found:
        raise TypeError(
            f"{type(model).__name__} has no flatshard Attention modules; context parallelism "
            "is for flatshard.models' GPT"
        )
    for attention in found:
        attention.context_parallel = cp
    return cp


def context_parallel_of(model: nn.Module) -> ContextParallel | None:
    """The :class:`ContextParallel` :func:`attach` gave ``model``, or None."""
    for module in model.modules():
        cp = getattr(module, "context_parallel", None)
        if isinstance(cp, ContextParallel):
            return cp
    return None
