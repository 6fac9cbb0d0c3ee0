"""The all-gather of one flat group: one path.

[Note: one gather path]
A gather writes each rank's shard (cast to the compute dtype, moved from an offloaded host
shard to the device on the way) into that rank's own chunk of the group's ``full`` buffer
(``world`` rows) and all-gathers in place from there (as FSDP2 does: no separate send buffer),
so the gathered bytes land where the parameter views read them (no copy-out). A bucket of
coalesced units is one unit with one group per kind (see [Note: coalesced units] in
buckets.py): no staging buffer either. The caller gets one ``PendingWork``; the ``full``
buffer is allocated first, on the compute stream, and on CUDA the rest runs on the gather
side stream (see [Note: streams and buffer lifetimes] in streams.py). The one exception: a
quantized gather (``fs.Comm(gather=...)``) travels in a buffer of its own and is decoded into
``full`` at the wait (see [Note: quantized weight gather] in features/quantized_gather.py).
"""

from __future__ import annotations

import torch

from flatshard.comm.collectives import CommStats, PendingWork, all_gather_into
from flatshard.core.flat_group import FlatGroup
from flatshard.core.mesh import Topology
from flatshard.core.streams import on_side_stream
from flatshard.features import float8, quantized_gather


def start_gather(group: FlatGroup, topo: Topology, stats: CommStats, label: str) -> PendingWork:
    """Async: every rank's shard of ``group`` into its ``full`` buffer."""
    group.allocate_full()
    return _gather_one(group, topo, stats, label)


def _gather_one(group: FlatGroup, topo: Topology, stats: CommStats, label: str) -> PendingWork:
    full = group.full.data
    if topo.shard_group is None:  # a group of one: the shard is the whole buffer
        return all_gather_into(full, send_shard(group, stats), None, stats, label)
    if quantized_gather.applies(group, stats.gather_wire):  # see its [Note]
        return quantized_gather.start(group, topo, stats, label)
    own = full.view(group.world, group.shard_numel)[group.rank]
    with on_side_stream(topo.streams, "gather"):
        write_send_shard(group, own, stats)
        return all_gather_into(full, own, topo.shard_group, stats, label)


def write_send_shard(group: FlatGroup, dest: torch.Tensor, stats: CommStats) -> None:
    """Write ``group``'s shard as a gather sends it into ``dest`` (one copy, casting to the
    compute dtype and moving an offloaded shard to the device on the way)."""
    if group.float8 is not None:  # quantized (see [Note: float8 all-gather])
        float8.write_send_shard(group, dest)
        return
    if group.offloaded:
        stats.record("offload_h2d", group.shard)
    dest.copy_(group.shard, non_blocking=group.offloaded)


def send_shard(group: FlatGroup, stats: CommStats) -> torch.Tensor:
    """``group``'s shard as a gather sends it: on the device, in the compute dtype."""
    if group.float8 is not None:  # quantized (see [Note: float8 all-gather])
        return float8.send_shard(group)
    send = group.shard
    if group.offloaded:  # to the device (a no-op copy on a CPU-only run)
        stats.record("offload_h2d", send)
        send = send.to(group.device, non_blocking=True)
    if send.dtype != group.compute_dtype:
        send = send.to(group.compute_dtype)
    return send
