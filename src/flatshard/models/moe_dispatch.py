"""Expert-parallel token dispatch: send routed tokens to the rank holding their expert, and back.

[Note: dispatch layout]
The MoE layer sorts its ``N*k`` (token, expert) assignments by global expert id, so the rows
bound for each expert, and hence for each EP rank (rank ``j`` holds experts
``j*E_l .. (j+1)*E_l - 1``), are contiguous. Dispatch then takes two ``all_to_all_single``:

1. the per-expert counts ``[ep, E_l]`` (even splits, one row per peer), so every rank knows how
   many rows it sends to and receives from each peer (the splits are uneven and change every
   step: they must be exchanged before the tokens);
2. the token rows themselves, with those uneven splits.

Received rows arrive grouped by source rank, then by local expert; a stable sort regroups them by
local expert for the expert computation, and :func:`combine` undoes that permutation and sends
each row back in the reverse all-to-all, to the slot it left. The token all-to-alls are an
autograd Function whose backward is the reverse all-to-all, so gradients reach the experts from
every rank's loss and come back to each rank's tokens.

Gloo supports uneven ``all_to_all_single`` on CPU (checked with torch 2.13, zero-row splits
included), so no point-to-point fallback is needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "ExpertRoute",
    "all_to_all_rows",
    "as_process_group",
    "combine",
    "dispatch",
    "local_expert_range",
]


def as_process_group(ep_group: ProcessGroup | DeviceMesh) -> ProcessGroup:
    """The process group of ``ep_group`` (a ProcessGroup, or a 1-D DeviceMesh)."""
    if isinstance(ep_group, DeviceMesh):
        if ep_group.ndim != 1:
            raise ValueError(
                f"ep_group is a {ep_group.ndim}-D DeviceMesh {tuple(ep_group.shape)}; pass its "
                "expert-parallel dimension, e.g. mesh['ep'] (a 1-D mesh)"
            )
        return ep_group.get_group()
    if isinstance(ep_group, ProcessGroup):
        return ep_group
    raise TypeError(
        f"ep_group must be a torch.distributed ProcessGroup or a 1-D DeviceMesh, "
        f"got {type(ep_group).__name__}"
    )


def local_expert_range(n_experts: int, group: ProcessGroup | None) -> tuple[int, int]:
    """(first expert, number of experts) this rank holds in ``group``; ``(0, n_experts)``
    without a group. Rank ``j`` of an ``ep``-rank group holds experts ``j*E_l .. (j+1)*E_l-1``."""
    if group is None:
        return 0, n_experts
    ep = dist.get_world_size(group)
    if n_experts % ep:
        raise ValueError(
            f"n_experts={n_experts} is not divisible by the expert-parallel size {ep}; use an EP "
            f"group whose size divides n_experts (e.g. {math.gcd(n_experts, ep)})"
        )
    n_local = n_experts // ep
    return dist.get_rank(group) * n_local, n_local


class _AllToAllRows(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 whose backward sends the gradients back the same way."""

    @staticmethod
    def forward(
        ctx,
        rows: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: ProcessGroup,
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = rows.new_empty((sum(output_splits), *rows.shape[1:]))  # [sum(out), ...]
        dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        output_splits, input_splits = ctx.splits
        # The reverse exchange: what each peer received from us, it now sends back as gradient.
        grad_in = grad_out.new_empty((sum(input_splits), *grad_out.shape[1:]))
        dist.all_to_all_single(
            grad_in, grad_out.contiguous(), input_splits, output_splits, group=ctx.group
        )
        return grad_in, None, None, None


def all_to_all_rows(
    rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group: ProcessGroup
) -> torch.Tensor:
    """Differentiable uneven all-to-all of ``rows [sum(input_splits), ...]`` over ``group``.

    Sends ``input_splits[j]`` consecutive rows to rank ``j`` of the group and returns the rows
    received, ``output_splits[j]`` from rank ``j``, in rank order: ``[sum(output_splits), ...]``.
    Every rank of ``group`` must call it (and, in backward, reach it) in the same order.
    """
    return _AllToAllRows.apply(rows, output_splits, input_splits, group)


@dataclass(frozen=True)
class ExpertRoute:
    """How one layer's rows travelled, kept to send the expert outputs back (see the Note)."""

    send_splits: list[int]
    """Rows this rank sent to each EP rank (its assignments to that rank's experts)."""
    recv_splits: list[int]
    """Rows this rank received from each EP rank."""
    by_expert: torch.Tensor
    """``[M]`` permutation of the received rows that groups them by local expert."""
    local_counts: list[int]
    """Rows per local expert after regrouping (``sum == M``), for :class:`Experts`."""


def dispatch(
    rows: torch.Tensor, counts: torch.Tensor, group: ProcessGroup
) -> tuple[torch.Tensor, ExpertRoute]:
    """Send ``rows [S, C]`` (sorted by global expert id) to the ranks holding their experts.

    ``counts [E]`` holds the rows per global expert (``sum == S``). Returns the rows this rank's
    ``E_l = E // ep`` experts must process, grouped by local expert (``[M, C]``), and the route
    that :func:`combine` needs to bring their outputs back.
    """
    ep = dist.get_world_size(group)
    counts_by_rank = counts.view(ep, -1)  # [ep, E_l]: row j = my rows for rank j's experts
    recv_counts = torch.empty_like(counts_by_rank)  # [ep, E_l]: row j = rank j's rows for mine
    dist.all_to_all_single(recv_counts, counts_by_rank, group=group)
    # One host read for every split (all_to_all_single takes Python ints; a device sync on GPU).
    send_splits, recv_table = counts_by_rank.sum(1).tolist(), recv_counts.tolist()
    recv_splits = [sum(row) for row in recv_table]
    received = all_to_all_rows(rows, recv_splits, send_splits, group)  # [M, C]
    n_local = counts_by_rank.shape[1]
    local_ids = torch.arange(n_local, device=rows.device).repeat(ep)  # [ep*E_l]
    row_expert = torch.repeat_interleave(local_ids, recv_counts.flatten())  # [M]
    by_expert = torch.argsort(row_expert, stable=True)  # [M]: source-major -> expert-major
    local_counts = [sum(row[e] for row in recv_table) for e in range(n_local)]
    route = ExpertRoute(send_splits, recv_splits, by_expert, local_counts)
    return received[by_expert], route


def combine(outputs: torch.Tensor, route: ExpertRoute, group: ProcessGroup) -> torch.Tensor:
    """Return expert ``outputs [M, C]`` (grouped as :func:`dispatch` gave them) to their senders.

    The result is ``[S, C]`` in the order of the ``rows`` this rank passed to :func:`dispatch`.
    """
    source_major = torch.empty_like(outputs)  # [M, C]
    # index_copy is differentiable in its source: the backward gathers with the same permutation.
    source_major = source_major.index_copy(0, route.by_expert, outputs)  # [M, C]
    return all_to_all_rows(source_major, route.send_splits, route.recv_splits, group)  # [S, C]
