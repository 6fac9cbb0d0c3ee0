"""Buckets of coalesced units: one all-gather and one reduce-scatter for several small units.

[Note: coalesced units]
A bucket is a run of units that follow each other in the recorded forward order (chosen by
``plan_buckets`` from ``fs.Coalesce``). Nothing about a member changes but *how its bytes
travel*: each member keeps its own flat layout, fragments, full buffer and state machine.

* **Gather.** When the training hooks gather (or prefetch) a member that is sharded, every
  member of its bucket that is sharded right then is gathered with it: each rank sends the
  concatenation of those members' shards once, into a staging buffer of ``world`` rows, and
  ``wait`` copies each member's column of rows into its full buffer. The members all become
  GATHERING with the one shared ``PendingWork``; whoever waits first does the copy. Ranks run
  the same state machine, so they agree on which members are sharded and on the sizes.
  Paths outside the step (summon, exports) gather one unit at a time, as before.
* **Reduce.** A member whose backward is over hands its flat gradients to the bucket instead of
  reducing them. When every trainable member has, one reduce-scatter of the members' flat
  gradients laid out chunk by chunk (row ``r`` of the staging buffer = every member's chunk
  ``r``) leaves this rank's shard of every member side by side; each member's
  ``PendingReduce`` views its part. At the end of backward a bucket that some but not all
  members reported to is reduced with zeros for the others, as an unreduced unit would be.
* Members gather into private buffers (not the gather pool): a bucket holds several units at
  once, and private buffers need no saved-tensor hooks.

The copies into and out of the staging buffers are the price (FSDP2 pays them for every
unit); they are why only units of at most ``Coalesce.unit_bytes`` are coalesced by default.
"""

from __future__ import annotations

from itertools import groupby

import torch

from ..coalesce import Coalesce
from ..comm.collectives import CommStats, PendingWork, all_gather_into, reduce_scatter_sum
from ..precision import sum_scaling
from .flat_group import FlatGroup, data_parallel_world, divided, then_replicas
from .mesh import Topology
from .unit import ParamState, PendingReduce, Unit

GradEntry = tuple[FlatGroup, torch.Tensor, torch.Tensor]  # (group, flat gradient, used mask)


class Bucket:
    """Units that share their collectives (see the Note)."""

    def __init__(self, index: int, units: list[Unit], topology: Topology, stats: CommStats):
        self.index = index
        self.units = units
        self.topology = topology
        self.stats = stats
        self.label = f"bucket {index} (units {', '.join(str(u.index) for u in units)})"
        self._grads: dict[int, list[GradEntry]] = {}  # unit index -> its flat gradients
        self._trainable = [u for u in units if u.trainable_groups]
        for unit in units:
            unit.bucket = self
            for group in unit.groups:
                group.pool = None  # private buffers, see the Note

    # ---- gather ------------------------------------------------------------------------------
    def start_gather(self) -> None:
        """Gather every member that is sharded now, in one collective per compute dtype."""
        members = [u for u in self.units if u.state is ParamState.SHARDED]
        if not members:
            return
        if len(members) == 1:
            members[0].start_gather()
            return
        groups = [g for u in members for g in u.groups]
        by_dtype = sorted(groups, key=lambda g: str(g.compute_dtype))
        works = [
            self._gather(list(gs)) for _, gs in groupby(by_dtype, key=lambda g: g.compute_dtype)
        ]
        for unit in members:
            unit.mark_gathering(works)

    def _gather(self, groups: list[FlatGroup]) -> PendingWork:
        world, process_group = self.topology.shard_world, self.topology.shard_group
        for g in groups:
            g.allocate_full()
        send = torch.cat([g.send_shard(self.stats) for g in groups])
        staging = send.new_empty(world * send.numel())
        work = all_gather_into(staging, send, process_group, self.stats, self.label)

        def copy_out(_timeout) -> None:
            rows, offset = staging.view(world, -1), 0
            for g in groups:
                n = g.shard_numel
                g.full.data.view(world, n).copy_(rows[:, offset : offset + n])
                offset += n

        work.add_then(copy_out)
        return work

    # ---- reduce ------------------------------------------------------------------------------
    def add_grads(self, unit: Unit) -> list[PendingReduce]:
        """``unit``'s backward is over: keep its flat gradients; once every trainable member's
        are here, start the bucket's reduction and return its pending parts."""
        self._grads[unit.index] = unit.take_flat_grads()
        if len(self._grads) < len(self._trainable):
            return []
        return self._launch()

    def flush(self) -> list[PendingReduce]:
        """End of backward: reduce what some members handed in, zeros for the others."""
        if not self._grads:
            return []
        for unit in self._trainable:
            if unit.index not in self._grads:
                self._grads[unit.index] = unit.take_flat_grads()
        return self._launch()

    def _launch(self) -> list[PendingReduce]:
        entries = [e for u in self._trainable for e in self._grads[u.index]]
        self._grads = {}
        by_dtype = sorted(entries, key=lambda e: str(e[0].reduce_dtype))
        pending: list[PendingReduce] = []
        for _, same in groupby(by_dtype, key=lambda e: e[0].reduce_dtype):
            pending += self._reduce(list(same))
        return pending

    def _reduce(self, entries: list[GradEntry]) -> list[PendingReduce]:
        topo, world = self.topology, self.topology.shard_world
        dtype, device = entries[0][0].reduce_dtype, entries[0][0].device
        total = sum(g.shard_numel for g, _, _ in entries)
        chunked = torch.empty(world, total, dtype=dtype, device=device)
        offset = 0
        for g, flat, _ in entries:
            chunked[:, offset : offset + g.shard_numel].copy_(flat.view(world, -1))
            offset += g.shard_numel
        pre, post = sum_scaling(dtype, data_parallel_world(topo))
        out = torch.empty(total, dtype=dtype, device=device)
        flat = divided(chunked.view(-1), pre)
        work = reduce_scatter_sum(out, flat, topo.shard_group, self.stats, self.label)
        then_replicas(work, out, topo, self.stats, self.label)
        work.add_then(lambda _: out.div_(post) if post != 1.0 else None)
        pending, offset = [], 0
        for g, _, used in entries:
            pending.append(PendingReduce(g, out[offset : offset + g.shard_numel], used, work))
            offset += g.shard_numel
        return pending


def coalescible(unit: Unit, root: torch.nn.Module) -> bool:
    """May ``unit`` share collectives? Not the root (gathered around every other unit's
    forward), and only sharded groups (no_shard has nothing to gather)."""
    return unit.module is not root and all(
        not g.replicated and unit.process_group is not None for g in unit.groups
    )


def gathered_bytes(unit: Unit) -> int:
    return sum(g.padded_numel * g.compute_dtype.itemsize for g in unit.groups)


def plan_buckets(order: list[Unit], config: Coalesce, root: torch.nn.Module) -> list[list[Unit]]:
    """Automatic buckets: maximal runs of consecutive coalescible units of at most
    ``unit_bytes`` each, cut where the run would exceed ``bucket_bytes``; runs of one unit
    stay alone."""
    runs: list[list[Unit]] = [[]]
    total = 0
    for unit in order:
        size = gathered_bytes(unit)
        small = coalescible(unit, root) and size <= config.unit_bytes
        if not small or total + size > config.bucket_bytes:
            runs.append([])
            total = 0
        if small:
            runs[-1].append(unit)
            total += size
    return [run for run in runs if len(run) > 1]


def named_buckets(
    config: Coalesce, units: list[Unit], names: dict[int, str], root: torch.nn.Module
) -> list[list[Unit]]:
    """``config.buckets`` resolved to units; ``ValueError`` for a name that is not a unit."""
    by_name = {names[id(u.module)]: u for u in units}
    resolved = []
    for bucket in config.buckets or ():
        members = []
        for name in bucket:
            unit = by_name.get(name)
            if unit is None or not coalescible(unit, root):
                why = "is the root" if unit is not None else "is not a unit of this model"
                raise ValueError(
                    f"Coalesce(buckets=...): {name!r} {why}; name modules the policy made "
                    f"units (fs.units(model) lists them): {sorted(n for n in by_name if n)}"
                )
            members.append(unit)
        resolved.append(members)
    return resolved
