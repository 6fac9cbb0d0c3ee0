"""The collectives of the whole-parameter optimizers: an all-to-all and a small all-reduce.

Both record themselves on the model's ``CommStats`` (``fs.comm_stats(model)`` counts them;
debug mode checks them like the engine's) and return a ``PendingWork`` whose wait is bounded.
A group of ``None`` is a group of one: the all-to-all is a copy, the all-reduce nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.collectives import PendingWork
from .whole import Comm

ALL_TO_ALL = "optim_all_to_all"
ALL_REDUCE = "optim_all_reduce"


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
