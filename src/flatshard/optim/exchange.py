"""The collectives of the whole-parameter optimizers: an all-to-all, a small all-reduce and,
with tensor parallelism, the all-gather of a matrix's TP-local blocks over the tp peers.

Both record themselves on the model's ``CommStats`` (``fs.comm_stats(model)`` counts them;
debug mode checks them like the engine's) and return a ``PendingWork`` whose wait is bounded.
A group of ``None`` is a group of one: the all-to-all is a copy, the all-reduce nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flatshard.comm.collectives import PendingWork
from flatshard.optim.whole import Comm
from flatshard.parallel.tensor import TPSpec

ALL_TO_ALL = "optim_all_to_all"
ALL_REDUCE = "optim_all_reduce"
ALL_GATHER_TP = "optim_all_gather_tp"


def all_to_all(
    out: torch.Tensor,
    send: torch.Tensor,
    out_splits: list[int],
    send_splits: list[int],
    group: dist.ProcessGroup | None,
    comm: Comm,
    label: str,
) -> PendingWork:
    """Async: this rank sends ``send``'s ``send_splits[d]`` elements (in order) to rank ``d``
    and receives ``out_splits[s]`` elements from rank ``s`` into ``out``, in rank order."""
    assert send.numel() == sum(send_splits) and out.numel() == sum(out_splits)
    if group is None:
        out.copy_(send)
        return PendingWork(None, ALL_TO_ALL)
    comm.stats.record(ALL_TO_ALL, send, group, label)
    work = dist.all_to_all_single(out, send, out_splits, send_splits, group=group, async_op=True)
    return PendingWork(work, ALL_TO_ALL, (out, send), label=label, group=group)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None, comm: Comm) -> None:
    """In place, blocking: the sum over ``group`` (small tensors: partial sums of squares)."""
    if group is None:
        return
    comm.stats.record(ALL_REDUCE, tensor, group, ALL_REDUCE)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    PendingWork(work, ALL_REDUCE, (tensor,), label=ALL_REDUCE, group=group).wait(comm.timeout)


def gather_over_tp(
    block: torch.Tensor, spec: TPSpec, group: dist.ProcessGroup, comm: Comm
) -> torch.Tensor:
    """Blocking: the global matrix from every tp peer's TP-local ``block`` (every tp peer
    calls it with its own block); ``block`` itself for a replicated parameter."""
    dims = [p.dim for p in spec.placements if p.is_shard()]
    if not dims:
        return block
    dim = dims[0] % len(spec.shape)
    size, world = spec.shape[dim], dist.get_world_size(group)
    # torch's Shard splits like torch.chunk: every block ``ceil(size / world)`` long but the
    # last non-empty one, then empty ones. Padded to that length, the blocks concatenate to
    # the global tensor followed by the padding.
    chunk = -(-size // world)
    moved = block.movedim(dim, 0)
    padded = moved.new_zeros((chunk, *moved.shape[1:]))
    padded[: moved.shape[0]].copy_(moved)
    out = moved.new_empty((world * chunk, *moved.shape[1:]))
    comm.stats.record(ALL_GATHER_TP, padded, group, ALL_GATHER_TP)
    work = dist.all_gather_into_tensor(out, padded, group=group, async_op=True)
    PendingWork(work, ALL_GATHER_TP, (out, padded), label=ALL_GATHER_TP, group=group).wait(
        comm.timeout
    )
    # contiguous, as the unsharded parameter is: the bf16 Newton–Schulz matmuls then run on
    # the same layout as torch's, so they round the same way
    return out[:size].movedim(0, dim).contiguous()
