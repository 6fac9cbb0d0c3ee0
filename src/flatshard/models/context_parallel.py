"""Context parallelism for the reference GPT: every row's tokens split over ``cp`` ranks.

[Note: head-tail context parallelism]
A row of ``T`` tokens is cut into ``2 * cp`` chunks; cp rank ``r`` holds chunk ``r`` and chunk
``2 * cp - 1 - r`` (:func:`head_tail_indices`). Under causal attention a late chunk attends to
far more keys than an early one, so pairing the ``r``-th earliest with the ``r``-th latest gives
every rank the same attention work. Everything per token (embedding, MLP, norms, the loss) is
local; only attention crosses ranks:

* **Keys and values cross the cp group** (below: a ring, or an all-gather), so each rank
  attends its ``T / cp`` queries to all ``T`` keys.
* **The causal mask comes from global positions**, not from local offsets: a rank's keys sit at
  row positions ``head_tail_indices(T, cp, rank)``, its queries likewise; key ``j`` is
  visible to query ``i`` when its position is not later and it belongs to the same document
  (packed rows carry several; padding is a document of its own). This is the 1-D causal,
  per-document attention exactly, only computed in another order.
* **RoPE** uses the tokens' positions in their documents, sliced like the tokens (the caller
  passes them as ``position_ids``).

Two ways to attend across the group (``ContextParallel(group, attention=...)``):

* ``"ring"`` (the default, :mod:`flatshard.models.ring_attention`): one peer's keys and values
  at a time, passed around the group while the previous block computes, merged by running
  softmax statistics; ``cp`` rounds per layer, one ``[t, t]`` score block and two key/value
  buffers in flight (``t = T / cp``): memory that does not grow with the row.
* ``"allgather"``: the whole row's keys and values gathered at once (:class:`_GatherKeys`) and
  one SDPA call of the ``[t, T]`` mask: fewer, larger messages, and memory that grows with
  ``T``.

* ``"torch"`` (:mod:`flatshard.models.torch_cp_attention`): torch's own context parallelism,
  FlexAttention under its ``_ContextParallel`` style with a block mask sharded by its head-tail
  balancer (torchtitan's recipe). Trains on accelerators only (torch 2.13's FlexAttention has
  no CPU backward); on the CPU it runs forward.

All three apply the same mask: key ``j`` visible to query ``i`` when its row position is not
later and it belongs to the same document.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from flatshard.models.ring_attention import RingLayout, ring_attention, ring_peers
from flatshard.models.torch_cp_attention import TorchContextAttention

# torch 2.13 renames all_gather_into_tensor (deprecated there); older torch has only that name
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = [
    "ATTENTIONS",
    "ContextParallel",
    "attach",
    "context_parallel_of",
    "head_tail_indices",
    "split_rows",
]

ATTENTIONS = ("ring", "allgather", "torch")  # how keys cross the cp group (see the note)


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

    def __init__(self, group: dist.ProcessGroup | DeviceMesh, attention: str = "ring") -> None:
        if attention not in ATTENTIONS:
            raise ValueError(
                f"attention={attention!r} is not a context-parallel attention; pass one of "
                f"{', '.join(map(repr, ATTENTIONS))}"
            )
        self.torch: TorchContextAttention | None = None  # attention="torch" only
        if isinstance(group, DeviceMesh):
            if attention == "torch":
                self.torch = TorchContextAttention(group)
            group = group.get_group()
        elif attention == "torch":
            raise TypeError(
                "attention='torch' (torch's context parallelism) needs the cp DeviceMesh, not a "
                "process group: pass mesh['cp']"
            )
        self.group, self.attention = group, attention
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.peers = ring_peers(group) if attention == "ring" else (0, 0)
        self.mask: torch.Tensor | None = None  # [B, 1, t, T] while attending ("allgather")
        self.layout: RingLayout | None = None  # while attending ("ring")

    @property
    def active(self) -> bool:
        torch_active = self.torch is not None and self.torch.active
        return self.mask is not None or self.layout is not None or torch_active

    @contextmanager
    def attending(self, document_ids: torch.Tensor) -> Iterator[None]:
        """Blocks attend across the cp group while inside; ``document_ids [B, t]`` are this
        rank's tokens' documents (head-tail split, ``-1`` padding), one small all-gather."""
        t = document_ids.shape[1]
        T, device = t * self.cp, document_ids.device
        if self.torch is not None:
            self.torch.check(T, device)  # before the collective below: every rank alike
        positions = [head_tail_indices(T, self.cp, r, device) for r in range(self.cp)]
        with torch.no_grad():
            k_doc = _GatherKeys.apply(document_ids, self.group)  # [B, T] in rank order
        if self.attention == "ring":
            documents = list(k_doc.split(t, dim=1))  # [B, t] per cp rank
            self.layout = RingLayout(
                self.group, self.rank, self.cp, positions, documents, self.peers
            )
        elif self.torch is not None:
            row_documents = torch.empty_like(k_doc)
            row_documents[:, torch.cat(positions)] = k_doc  # rank order -> row order
            self.torch.prepare(row_documents)
        else:
            q_pos, k_pos = positions[self.rank], torch.cat(positions)  # [t], [T]
            causal = k_pos[None, :] <= q_pos[:, None]  # [t, T]
            same_doc = document_ids[:, :, None] == k_doc[:, None, :]  # [B, t, T]
            self.mask = (causal & same_doc).unsqueeze(1)  # [B, 1, t, T]
        try:
            yield
        finally:
            self.mask = self.layout = None
            if self.torch is not None:
                self.torch.release()

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q [B, t, H, D]``, ``k``/``v [B, t, KV, D]`` (this rank's tokens, RoPE applied) ->
        ``[B, t, H, D]``: this rank's queries over the whole row's keys."""
        if self.layout is not None:
            y = ring_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.layout)
            return y.transpose(1, 2)  # [B, t, H, D]
        if self.torch is not None and self.torch.active:
            y = self.torch.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            return y.transpose(1, 2)  # [B, t, H, D]
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


def attach(
    model: nn.Module, group: dist.ProcessGroup | DeviceMesh, attention: str = "ring"
) -> ContextParallel:
    """Make every :class:`~flatshard.models.block.Attention` of ``model`` context-parallel over
    ``group`` (the cp process group, or the 1-D cp ``DeviceMesh``, which ``"torch"`` needs; one
    shared :class:`ContextParallel`, returned; ``attention``: ``"ring"``, ``"allgather"`` or
    ``"torch"``, see the note). Call before ``fs.shard``."""
    from flatshard.models.block import Attention

    cp = ContextParallel(group, attention)
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
