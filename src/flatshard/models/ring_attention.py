"""Ring attention over a cp group: one peer's keys and values at a time, never the whole row.

[Note: ring attention over head-tail shards]
Each cp rank holds its queries, keys and values for chunks ``r`` and ``2cp-1-r`` of every row
(see [Note: head-tail context parallelism] in ``models/context_parallel.py``). The ring runs
``cp`` steps. At step ``i`` a rank holds the keys and values of rank ``src = rank - i`` (mod cp):
it attends its queries to them while the next ones travel, and merges the block into running
softmax statistics (running row max ``m``, running sum ``l`` and the unnormalised output): the
merged output equals softmax attention over the whole row, in another summation order.

* **Which sub-block is computed** (head-tail makes it structural, with no host sync): the own
  block (``src == rank``) fully, under its causal and document mask; a lower rank's block
  (``src < rank``) only its head chunk's keys (its tail is later than all our queries) against
  all our queries; a higher rank's block (``src > rank``) all its keys against only our tail
  chunk's queries (our head is earlier than all its keys). Every rank thus computes one full
  block and ``cp - 1`` half blocks: the same work on every rank.
* **Step 0 is the own block**, where every query sees at least itself, so ``m`` is finite after
  it and later fully masked rows merge as zeros (``exp(-inf - m) = 0``), never NaN.
* **Backward** recomputes each block's probabilities from the saved log-sum-exp. The query
  gradient stays home; the key and value gradients travel *with* their keys around the ring,
  each rank adding its share, and one last hop brings every block's sum back to its owner
  (``cp`` hops for the gradients, ``cp - 1`` for the keys).
* **Precision**: blocks are computed in at least fp32 (float64 stays float64), the outputs and
  gradients cast back to the inputs' dtypes; the travelling gradients stay in that precision.
* **Grouped-query attention** without repeating keys: queries are viewed
  ``[B, KV, G, t, D]`` (query head ``h`` reads key head ``h // G``, as SDPA's ``enable_gqa``
  does) and keys ``[B, KV, 1, t, D]`` broadcast over ``G``; key gradients sum over ``G``.

Memory: one ``[B, H, t, t]`` score block (``t = T / cp``) and two key/value buffers in flight,
where the all-gather attention holds ``[B, H, t, T]`` and the whole row's keys and values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["RingLayout", "ring_attention", "ring_peers"]

_TAG = 0x52494E  # "RIN": this module's point-to-point tag (see comm/gloo_p2p.py's note)


@dataclass
class RingLayout:
    """Where every token of the row sits, for one micro-batch: this rank's query positions and
    documents, and every cp rank's (in cp rank order) for its keys."""

    group: dist.ProcessGroup
    rank: int
    cp: int
    positions: list[torch.Tensor]  # per cp rank: [t] positions of its tokens in the row
    documents: list[torch.Tensor]  # per cp rank: [B, t] document ids (-1: padding)
    peers: tuple[int, int]  # global ranks of the next and the previous cp rank

    def block(self, src: int) -> tuple[slice, slice, torch.Tensor]:
        """The query rows and key columns of ``src``'s block that can see anything (see the
        note) and their mask ``[B, 1, 1, tq, tk]`` (causal by row position, same document)."""
        t, half = self.positions[src].shape[0], self.positions[src].shape[0] // 2
        rows, cols = slice(0, t), slice(0, t)
        if src < self.rank:
            cols = slice(0, half)  # src's head chunk only
        elif src > self.rank:
            rows = slice(half, t)  # our tail chunk only
        q_pos, k_pos = self.positions[self.rank][rows], self.positions[src][cols]
        q_doc, k_doc = self.documents[self.rank][:, rows], self.documents[src][:, cols]
        visible = (k_pos[None, None, :] <= q_pos[None, :, None]) & (
            q_doc[:, :, None] == k_doc[:, None, :]
        )  # [B, tq, tk]
        return rows, cols, visible[:, None, None]


def ring_peers(group: dist.ProcessGroup) -> tuple[int, int]:
    """Global ranks of this rank's next and previous cp rank in ``group`` (the ring's order)."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    return (
        dist.get_global_rank(group, (rank + 1) % cp),
        dist.get_global_rank(group, (rank - 1) % cp),
    )


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: RingLayout
) -> torch.Tensor:
    """``q [B, H, t, D]``, ``k``/``v [B, KV, t, D]`` (this rank's tokens) -> ``[B, H, t, D]``:
    this rank's queries attended over the whole row's keys (see the note)."""
    B, H, t, D = q.shape
    KV = k.shape[1]
    if H % KV:
        raise ValueError(f"query heads {H} are not a multiple of key/value heads {KV}")
    grouped = q.reshape(B, KV, H // KV, t, D)  # query head h reads key head h // G
    out = _RingAttention.apply(grouped, k.unsqueeze(2), v.unsqueeze(2), layout)
    return out.reshape(B, H, t, D)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _rotate(buffer: torch.Tensor, layout: RingLayout) -> tuple[torch.Tensor, list]:
    """Post sending ``buffer`` to the next cp rank and receiving the previous one's."""
    received = torch.empty_like(buffer)
    nxt, prev = layout.peers
    ops = [
        dist.P2POp(dist.isend, buffer, nxt, layout.group, _TAG),
        dist.P2POp(dist.irecv, received, prev, layout.group, _TAG),
    ]
    return received, dist.batch_isend_irecv(ops)


def _split(buffer: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    n = shape.numel()
    return buffer[:n].view(shape), buffer[n:].view(shape)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout: RingLayout):  # q [B,KV,G,t,D]; k, v [B,KV,1,t,D]
        dtype = _compute_dtype(q.dtype)
        scale = 1.0 / math.sqrt(q.shape[-1])
        acc = torch.zeros(q.shape, dtype=dtype, device=q.device)  # unnormalised output
        row_max = torch.full(q.shape[:-1], -math.inf, dtype=dtype, device=q.device)
        row_sum = torch.zeros(q.shape[:-1], dtype=dtype, device=q.device)
        kv = torch.cat([k.reshape(-1), v.reshape(-1)])
        for step in range(layout.cp):
            src = (layout.rank - step) % layout.cp
            if step < layout.cp - 1:  # the next keys travel while this block computes
                incoming, works = _rotate(kv, layout)
            k_src, v_src = _split(kv, k.shape)
            rows, cols, visible = layout.block(src)
            scores = _scores(q[..., rows, :], k_src[..., cols, :], visible, scale, dtype)
            new_max = torch.maximum(row_max[..., rows], scores.amax(-1))
            probs = torch.exp(scores - new_max[..., None])
            keep = torch.exp(row_max[..., rows] - new_max)  # rescales the earlier blocks
            row_sum[..., rows] = row_sum[..., rows] * keep + probs.sum(-1)
            acc[..., rows, :] = acc[..., rows, :] * keep[..., None] + probs @ v_src[
                ..., cols, :
            ].to(dtype)
            row_max[..., rows] = new_max
            if step < layout.cp - 1:
                for work in works:
                    work.wait()
                kv = incoming
        out = acc / row_sum[..., None]
        lse = row_max + torch.log(row_sum)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.scale = layout, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        layout, scale, dtype = ctx.layout, ctx.scale, out.dtype
        grad_out = grad_out.to(dtype)
        delta = (grad_out * out).sum(-1)  # [B,KV,G,t]: the softmax backward's row term
        grad_q = torch.zeros(q.shape, dtype=dtype, device=q.device)
        kv = torch.cat([k.reshape(-1), v.reshape(-1)])
        grad_kv = torch.zeros(kv.shape, dtype=dtype, device=kv.device)  # travels with kv
        for step in range(layout.cp):
            src = (layout.rank - step) % layout.cp
            if step < layout.cp - 1:
                incoming, works = _rotate(kv, layout)
            else:
                works = []
            k_src, v_src = _split(kv, k.shape)
            grad_k, grad_v = _split(grad_kv, k.shape)
            blocks = (q, k_src, v_src, grad_out, lse, delta)
            _block_grads(layout.block(src), blocks, (grad_q, grad_k, grad_v), scale, dtype)
            sent = grad_kv  # held to the wait: the send reads it (NCCL: on its own stream)
            grad_kv, grad_works = _rotate(sent, layout)  # on to the block's next rank
            for work in works + grad_works:
                work.wait()
            del sent
            if step < layout.cp - 1:
                kv = incoming
        grad_k, grad_v = _split(grad_kv, k.shape)  # home after cp hops: our keys' full sums
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None


def _scores(q, k, visible, scale, dtype):
    """Masked scaled scores ``[B, KV, G, tq, tk]`` (``-inf`` where not visible)."""
    scores = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale
    return scores.masked_fill(~visible, -math.inf)


def _block_grads(block, tensors, grads, scale, dtype) -> None:
    """Add one block's contribution to the query, key and value gradients (in place)."""
    rows, cols, visible = block
    q, k_src, v_src, grad_out, lse, delta = tensors
    grad_q, grad_k, grad_v = grads
    qb, kb, vb = q[..., rows, :].to(dtype), k_src[..., cols, :], v_src[..., cols, :].to(dtype)
    probs = torch.exp(_scores(qb, kb, visible, scale, dtype) - lse[..., rows, None])
    dout = grad_out[..., rows, :]
    grad_v[..., cols, :] += (probs.transpose(-1, -2) @ dout).sum(2, keepdim=True)
    dscores = probs * (dout @ vb.transpose(-1, -2) - delta[..., rows, None]) * scale
    grad_q[..., rows, :] += dscores @ kb.to(dtype)
    grad_k[..., cols, :] += (dscores.transpose(-1, -2) @ qb).sum(2, keepdim=True)
