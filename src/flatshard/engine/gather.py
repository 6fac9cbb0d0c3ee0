"""The all-gather of one flat group or of several at once: one path.

[Note: one gather path]
A gather writes each rank's shard (cast to the compute dtype, moved from an offloaded host
shard to the device on the way) into that rank's own chunk of a buffer of ``world`` rows and
all-gathers in place from there (as FSDP2 does: no separate send buffer).
- One group (a unit): the buffer is the group's ``full`` buffer itself, so the gathered bytes
  land where the parameter views read them (no copy-out).
- Several groups (a bucket, buckets.py): the buffer is a staging buffer whose row ``r`` is the
  concatenation of every group's chunk ``r``; the wait copies each group's column of rows into
  its ``full`` buffer, then gives the staging buffer back.
Either way the caller gets one ``PendingWork``; the ``full`` buffers are allocated first, on
the compute stream, and on CUDA the rest runs on the gather side stream (see [Note: streams
and buffer lifetimes] in streams.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..comm.collectives import CommStats, PendingWork, all_gather_into
from .flat_group import FlatGroup
from .mesh import Topology
from .streams import on_side_stream

# (numel, dtype) -> a scratch buffer; and its way back (buckets borrow from the gather pool)
Borrow = Callable[[int, torch.dtype], torch.Tensor]
GiveBack = Callable[[torch.Tensor], None]


def start_gather(
    groups: list[FlatGroup],
    topo: Topology,
    stats: CommStats,
    label: str,
    scratch: tuple[Borrow, GiveBack] | None = None,
) -> PendingWork:
    """Async: every rank's shard of each of ``groups`` (one compute dtype) into their
    ``full`` buffers; ``scratch`` lends the staging buffer when there are several."""
    for g in groups:
        g.allocate_full()
    if len(groups) == 1:
        return _gather_one(groups[0], topo, stats, label)
    assert scratch is not None, "several groups gather through a staging buffer"
    borrow, give_back = scratch
    world, total = topo.shard_world, sum(g.shard_numel for g in groups)
    staging = borrow(world * total, groups[0].compute_dtype)  # on the compute stream (rule 1)
    own, offset = staging.view(world, total)[topo.shard_rank], 0
    with on_side_stream(topo.side_stream("gather")):
        for g in groups:
            write_send_shard(g, own[offset : offset + g.shard_numel], stats)
            offset += g.shard_numel
        work = all_gather_into(staging, own, topo.shard_group, stats, label)

    def copy_out(_timeout) -> None:
        rows, offset = staging.view(world, -1), 0
        for g in groups:
            n = g.shard_numel
            g.full.data.view(world, n).copy_(rows[:, offset : offset + n])
            offset += n
        give_back(staging)

    work.add_then(copy_out)
    return work


def _gather_one(group: FlatGroup, topo: Topology, stats: CommStats, label: str) -> PendingWork:
    full = group.full.data
    if topo.shard_group is None:  # a group of one: the shard is the whole buffer
        return all_gather_into(full, send_shard(group, stats), None, stats, label)
    own = full.view(group.world, group.shard_numel)[group.rank]
    with on_side_stream(topo.side_stream("gather")):
        write_send_shard(group, own, stats)
        return all_gather_into(full, own, topo.shard_group, stats, label)


def write_send_shard(group: FlatGroup, dest: torch.Tensor, stats: CommStats) -> None:
    """Write ``group``'s shard as a gather sends it into ``dest`` (one copy, casting to the
    compute dtype and moving an offloaded shard to the device on the way)."""
    if group.offloaded:
        stats.record("offload_h2d", group.shard)
    dest.copy_(group.shard, non_blocking=group.offloaded)


def send_shard(group: FlatGroup, stats: CommStats) -> torch.Tensor:
    """``group``'s shard as a gather sends it: on the device, in the compute dtype."""
    send = group.shard
    if group.offloaded:  # to the device (a no-op copy on a CPU-only run)
        stats.record("offload_h2d", send)
        send = send.to(group.device, non_blocking=True)
    if send.dtype != group.compute_dtype:
        send = send.to(group.compute_dtype)
    return send
