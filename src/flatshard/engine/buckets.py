"""Buckets of coalesced units: one all-gather and one reduce-scatter for several small units.

[Note: coalesced units]
A bucket is a run of units that follow each other in the modules' order, chosen at
``fs.shard`` (``plan_for``, from ``fs.Coalesce``) and checked against the first forward.
Nothing about a member changes but *how its bytes travel*: each member keeps its own flat
layout, fragments, full buffer and state machine.

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
* Memory: the members' private buffers are views of one ``SharedStorage`` per bucket (one
  allocation per bucket gather, released when the last member releases; no saved-tensor
  hooks needed; ``StorageCache`` keeps the memory of the first few released storages for
  their next gather instead of freeing it), the gradients are written straight from
  autograd's per-parameter gradients into the bucket's chunked buffer (no flat copy per
  member), and the staging and chunked scratch buffers are borrowed from the gather pool when
  the model has one. Under ``MALLOC_MMAP_THRESHOLD_=65536`` every fresh buffer is a fresh
  mapping with page faults; one buffer per member per gather made 100 tiny units 1.24x slower
  (measured).

The copies into and out of the staging buffers are the price (FSDP2 pays them for every
unit); they are why only units of at most ``Coalesce.unit_bytes`` are coalesced by default.
"""

from __future__ import annotations

import torch

from ..coalesce import Coalesce
from ..comm.collectives import CommStats
from .bucket_storage import SharedStorage, StorageCache
from .flat_group import FlatGroup
from .gather import start_gather
from .gather_pool import GatheredBytes, GatherPool
from .mesh import Topology
from .reduce import PendingReduce, reduce_chunked, write_chunked
from .unit import ParamState, Unit

GradEntry = tuple[FlatGroup, "torch.Tensor | tuple", torch.Tensor]  # (group, gradient, used)


class Bucket:
    """Units that share their collectives (see the Note)."""

    def __init__(
        self,
        index: int,
        units: list[Unit],
        topology: Topology,
        stats: CommStats,
        pool: GatherPool | None,
        account: GatheredBytes,
        cache: StorageCache | None = None,
        timeout=None,
    ) -> None:
        self.index = index
        self.units = units
        self.topology = topology
        self.stats = stats
        self.pool = pool  # lends the staging buffers (never a member's own buffer)
        self.timeout = timeout  # bounds the waits a reduction may chain (see reduce.py)
        self.label = f"bucket {index} (units {', '.join(str(u.index) for u in units)})"
        self._grads: dict[torch.dtype, tuple[torch.Tensor, list]] = {}  # see add_grads
        self._reported: set[int] = set()
        self._trainable = [u for u in units if u.trainable_groups]
        groups = [g for u in units for g in u.groups]
        self.storages = [
            SharedStorage(list(gs), account, cache) for gs in _by(groups, "compute_dtype")
        ]
        trainable = [u.groups[i] for u in self._trainable for i in u.trainable_groups]
        self._offsets = _offsets(trainable)
        for unit in units:
            unit.bucket = self

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
        scratch = (self._scratch, self._release)
        works = [
            start_gather(gs, self.topology, self.stats, self.label, scratch)
            for gs in _by(groups, "compute_dtype")
        ]
        for unit in members:
            unit.mark_gathering(works)

    def _scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        device = self.topology.device
        if self.pool is None:
            return torch.empty(numel, dtype=dtype, device=device)
        return self.pool.acquire(numel, dtype, device, owner=self)[:numel]

    def _release(self, scratch: torch.Tensor) -> None:
        if self.pool is not None:
            self.pool.release(scratch._base if scratch._base is not None else scratch)

    # ---- reduce ------------------------------------------------------------------------------
    def add_grads(self, unit: Unit) -> list[PendingReduce]:
        """``unit``'s backward is over: write its gradients into the bucket's chunked buffer
        (row ``r`` = every member's chunk ``r``) right away; once every trainable member's are
        in, start the bucket's reduction and return its pending parts."""
        for group, grad, used in unit.take_flat_grads():
            self._write(group, grad, used)
        self._reported.add(unit.index)
        if len(self._reported) < len(self._trainable):
            return []
        return self._launch()

    def flush(self) -> list[PendingReduce]:
        """End of backward: reduce what some members handed in, zeros for the others."""
        if not self._reported:
            return []
        for unit in self._trainable:
            if unit.index not in self._reported:
                for group, _, used in unit.take_flat_grads():
                    self._write(group, None, used)
        return self._launch()

    def _write(self, group: FlatGroup, grad, used: torch.Tensor) -> None:
        dtype = group.reduce_dtype
        if dtype not in self._grads:
            world, total = self.topology.shard_world, self._offsets[dtype][1]
            chunked = self._scratch(world * total, dtype).view(world, total)
            self._grads[dtype] = (chunked, [])
        chunked, entries = self._grads[dtype]
        offset = self._offsets[dtype][0][id(group)]
        region = chunked[:, offset : offset + group.shard_numel]  # every element is written
        if grad is None:
            region.zero_()
        else:
            write_chunked(region, group, grad)
        entries.append((group, offset, used))

    def _launch(self) -> list[PendingReduce]:
        self._reported = set()
        grads, self._grads = self._grads, {}
        return [p for chunked, entries in grads.values() for p in self._reduce(chunked, entries)]

    def _reduce(self, chunked: torch.Tensor, entries: list) -> list[PendingReduce]:
        topo, stats, label = self.topology, self.stats, self.label
        pending, work = reduce_chunked(chunked, entries, topo, stats, label, self.timeout)
        work.add_then(lambda _: self._release(chunked))
        return pending


def _by(groups: list, attr: str) -> list[list]:
    """``groups`` split by the value of ``attr`` (order kept within each part)."""
    parts: dict = {}
    for g in groups:
        parts.setdefault(getattr(g, attr), []).append(g)
    return list(parts.values())


def _offsets(groups: list[FlatGroup]) -> dict[torch.dtype, tuple[dict[int, int], int]]:
    """Per reduce dtype: each group's column offset in the chunked gradient, and the total."""
    out: dict[torch.dtype, tuple[dict[int, int], int]] = {}
    for part in _by(groups, "reduce_dtype"):
        offsets, total = {}, 0
        for g in part:
            offsets[id(g)] = total
            total += g.shard_numel
        out[part[0].reduce_dtype] = (offsets, total)
    return out


def coalescible(unit: Unit, root: torch.nn.Module) -> bool:
    """May ``unit`` share collectives? Not the root (gathered around every other unit's
    forward), and only sharded groups (no_shard has nothing to gather)."""
    if unit.topology.divide_by is not None:  # on its own mesh: see [Note: per-unit meshes]
        return False
    return unit.module is not root and all(
        not g.replicated and unit.process_group is not None for g in unit.groups
    )


def gathered_bytes(unit: Unit) -> int:
    return sum(g.padded_numel * g.compute_dtype.itemsize for g in unit.groups)


def plan_buckets(order: list[Unit], config: Coalesce, root: torch.nn.Module) -> list[list[Unit]]:
    """Automatic buckets: maximal runs of consecutive coalescible units of at most
    ``unit_bytes`` each (in ``order``: the modules' order, see ``module_order``), cut where the
    run would exceed ``bucket_bytes``; runs of one unit stay alone."""
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


def module_order(units: list[Unit], root: torch.nn.Module) -> list[Unit]:
    """``units`` in the order of their modules in ``root.modules()`` (a parent before its
    children, siblings in registration order: the order a forward usually runs them)."""
    rank = {id(m): i for i, m in enumerate(root.modules())}
    return sorted(units, key=lambda u: (rank[id(u.module)], u.is_tail))


def bucket_order_message(bucket: Bucket, forward_order: list[Unit]) -> str:
    """The warning when a bucket's members did not run one after another in the forward."""
    names = [type(u.module).__name__ + f"#{u.index}" for u in bucket.units]
    ran = [f"{type(u.module).__name__}#{u.index}" for u in forward_order]
    return (
        f"flatshard: bucket {bucket.index} ({', '.join(names)}) was planned at fs.shard from "
        f"the modules' order, but its units did not run one after another in the first "
        f"forward (forward order: {', '.join(ran[:12])}{' ...' if len(ran) > 12 else ''}). "
        "Results are unaffected, but the bucket holds its members' gathered parameters "
        "longer than needed. Pass fs.shard(..., coalesce=fs.Coalesce(buckets=[[names of "
        "modules that run one after another], ...])) or coalesce=False."
    )


def plan_for(config: Coalesce, units: list[Unit], root: torch.nn.Module) -> list[list[Unit]]:
    """The buckets of ``fs.shard``: the explicit ones, or automatic in module order."""
    if config.buckets is not None:
        names = {id(m): n for n, m in root.named_modules()}
        return named_buckets(config, units, names, root)
    if not config.enabled:
        return []
    return plan_buckets(module_order(units, root), config, root)


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
