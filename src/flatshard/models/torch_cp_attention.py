"""torch's own context parallelism as the GPT's cp attention (``attention="torch"``).

[Note: torch's context parallelism in flatshard]
The third way across the cp group (beside flatshard's ring and all-gather, see
[Note: head-tail context parallelism] in ``models/context_parallel.py``) is torch's: the
attention call is FlexAttention wrapped by torch's ``_ContextParallel`` style (a forward pre-hook
that all-gathers the keys and values over the cp mesh with torch's ``flex_cp_allgather``, whose
backward reduce-scatters their gradients), with a block mask sharded by torch's head-tail
balancer (``_HeadTailLoadBalancer``). That is torchtitan's recipe for
FlexAttention under context parallelism (its ``cp_shard``), kept to what the GPT needs:

* **The same shares as flatshard's split.** torch's head-tail balancer gives cp rank ``r``
  chunks ``r`` and ``2cp - 1 - r`` of ``2cp``, exactly ``head_tail_indices`` (a test compares
  them), so the trainer's data split, RoPE positions and loss stay as they are; torch's
  all-gathered keys come in cp-rank order, which its rewritten mask maps back to row positions.
* **The same mask.** The block mask is built from the whole row's documents (gathered once per
  micro-batch, a small all-gather of ints): key ``j`` visible to query ``i`` when it is not
  later and in the same document (padding is a document of its own), the mask of the ring and
  the all-gather attention. So packed rows stay apart, which torch's SDPA context parallelism
  (``is_causal`` over the whole row) could not do. The mask is torch's ``_create_cp_block_mask``
  (what ``_context_parallel_shard`` calls for a block mask): this rank's query blocks against
  the whole row, built by a compiled ``create_block_mask``, never the ``[T, T]`` mask.
* **Where it runs.** FlexAttention has no CPU backward in torch 2.13, so training with it needs
  an accelerator; on CUDA the attention call is ``torch.compile``-d (eager FlexAttention
  materialises every score). On the CPU it runs forward only (what the tests check: its outputs
  equal the ring's and the whole row's). :meth:`TorchContextAttention.check` refuses a CPU pass
  that records gradients, naming the fix, before the micro-batch's first collective.
* **Row length.** torch shards the block mask in blocks of 128 tokens per cp rank, so a row must
  be a multiple of ``cp * 128`` (and of ``2 * cp``, for the head-tail split):
  :func:`check_row_length` says so before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MASK_BLOCK", "TorchContextAttention", "check_row_length", "row_fits"]

MASK_BLOCK = 128  # torch's default FlexAttention block, the unit of its sharded block mask


def row_fits(seq_len: int, cp: int) -> bool:
    """Whether torch's sharded block mask can split a row of ``seq_len`` over ``cp`` ranks."""
    return seq_len % (cp * MASK_BLOCK) == 0 and seq_len % (2 * cp) == 0


def check_row_length(seq_len: int, cp: int) -> None:
    """Refuse a row that torch's sharded block mask cannot split (see the note above)."""
    unit = cp * MASK_BLOCK
    if not row_fits(seq_len, cp):
        raise ValueError(
            f"seq_len={seq_len} is not a multiple of cp * {MASK_BLOCK} = {unit}: torch's "
            "context-parallel FlexAttention shards its block mask in blocks of "
            f"{MASK_BLOCK} tokens per cp rank; use a row length that is a multiple of "
            f"{unit}, or the ring attention (attention='ring')"
        )


_compiled: dict[str, Callable[..., Any]] = {}


def _flex_attention(device_type: str) -> Callable[..., Any]:
    """FlexAttention for ``device_type``: compiled on accelerators (fused, no [t, T] scores),
    eager on the CPU (forward only there; see the note)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device_type == "cpu":
        return flex_attention
    if device_type not in _compiled:
        _compiled[device_type] = torch.compile(flex_attention, dynamic=False)
    return _compiled[device_type]


class _FlexCall(nn.Module):
    """The module torch's ``_ContextParallel(FLEX)`` hooks: its pre-hook swaps the local keys and
    values for the cp group's (all-gathered, in cp-rank order) before the call."""

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        return _flex_attention(query.device.type)(query, key, value, **kwargs)


class TorchContextAttention:
    """torch's context-parallel FlexAttention over a 1-D cp ``mesh`` (see the note above)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        from torch.distributed.tensor.experimental._context_parallel import _ContextParallel
        from torch.distributed.tensor.parallel import parallelize_module

        if mesh.ndim != 1:
            raise ValueError(
                f"attention='torch' needs the 1-D cp mesh, got a {mesh.ndim}-D mesh "
                f"{mesh.mesh_dim_names}; pass mesh['cp']"
            )
        self.mesh, self.cp = mesh, mesh.size()
        self.call = _FlexCall()
        style = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX)
        parallelize_module(self.call, mesh, style)
        self.block_mask: Any = None  # torch's BlockMask for this rank's queries, per micro-batch

    def check(self, seq_len: int, device: torch.device) -> None:
        """Refuse a micro-batch this attention cannot run (every rank alike, before any
        collective): a row torch cannot split, or a CPU pass that records gradients."""
        check_row_length(seq_len, self.cp)
        if device.type == "cpu" and torch.is_grad_enabled():
            raise RuntimeError(
                "attention='torch' (torch's context-parallel FlexAttention) cannot train on the "
                "CPU: torch 2.13's FlexAttention has no CPU backward; use attention='ring' or "
                "'allgather' (flatshard's own, on every device), or run on a GPU"
            )

    def prepare(self, documents: torch.Tensor) -> None:
        """Build this rank's block mask from ``documents [B, T]``: the whole rows' document
        ids in row order (``-1``: padding)."""
        from torch.distributed.tensor.experimental._context_parallel import _HeadTailLoadBalancer
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _create_cp_block_mask,
        )

        B, T = documents.shape

        def same_document_causal(b, h, q_idx, kv_idx):  # row positions (torch maps them)
            return (kv_idx <= q_idx) & (documents[b, q_idx] == documents[b, kv_idx])

        # What torch's _context_parallel_shard does for a BlockMask, without first building the
        # whole row's mask (which it would discard): this rank's query blocks, compiled.
        balancer = _HeadTailLoadBalancer(T, self.cp, documents.device)
        self.block_mask = _create_cp_block_mask(
            same_document_causal, B, 1, T, T, self.mesh, balancer
        )

    def release(self) -> None:
        self.block_mask = None

    @property
    def active(self) -> bool:
        return self.block_mask is not None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q [B, H, t, D]``, ``k``/``v [B, KV, t, D]`` (this rank's) -> ``[B, H, t, D]``."""
        if self.block_mask is None:
            raise RuntimeError("TorchContextAttention.attend outside ContextParallel.attending")
        return self.call(q, k, v, block_mask=self.block_mask, enable_gqa=k.shape[1] != q.shape[1])
