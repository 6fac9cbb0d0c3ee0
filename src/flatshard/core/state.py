"""The per-model runtime state: units, process group, orders for prefetch, in-flight reductions.

One ``ShardedState`` hangs off the root module (``model._flatshard_state``); nothing is global,
so two sharded models in one process never see each other.

[Note: stale gathered buffers]
A unit may stay gathered after its forward (the root, or every unit under ``shard_grad_op``).
If the optimizer steps (or a state dict is loaded) while it is gathered, the full buffer would be
stale. Each group remembers its shard's autograd version counter at gather time; the optimizer's
in-place update bumps it (fragments are views of the shard and share its counter), and a unit
whose shard moved on is regathered before use.
"""

from __future__ import annotations

import datetime
import enum
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from flatshard import offload
from flatshard.coalesce import Coalesce
from flatshard.comm.collectives import CommStats
from flatshard.core.mesh import Topology
from flatshard.core.reduce import PendingReduce
from flatshard.core.switches import Switches
from flatshard.core.unit import ForwardPass, ParamState, Unit
from flatshard.core.usage import start_agreement
from flatshard.features.buckets import bucket_order_message
from flatshard.features.gather_pool import GatheredBytes, GatherPool, pays_off
from flatshard.prefetch import Prefetch

if TYPE_CHECKING:  # for the annotation only: parallel/ imports this module
    from flatshard.parallel.tensor import TPGroups


class StateMode(enum.Enum):
    """What the model's hooks do right now."""

    TRAIN = "train"  # gather, compute on views, reduce, release
    SUMMONED = "summoned"  # inside summon_full_params: full parameters installed, hooks aside
    ACCUMULATE = "accumulate"  # inside no_sync(keep="unsharded"): flat gradients kept
    # inside fs.pipeline_step: flat gradients kept over the schedule's microbatches (and its
    # split backward), reduced once when the step ends (see parallel/pipeline_step.py)
    PIPELINE = "pipeline"

    @property
    def defers_reduction(self) -> bool:
        """Backward keeps the units' flat gradients instead of reducing them."""
        return self in (StateMode.ACCUMULATE, StateMode.PIPELINE)


@dataclass
class StepOrder:
    """Unit order observed on the first iteration, used for prefetching afterwards."""

    recording: list[Unit] = field(default_factory=list)
    frozen: list[Unit] | None = None
    next_of: dict[int, Unit] = field(default_factory=dict)

    def observe(self, unit: Unit) -> None:
        if self.frozen is None and unit not in self.recording:
            self.recording.append(unit)

    def freeze(self) -> None:
        if self.frozen is None and self.recording:
            self.frozen = self.recording
            self.next_of = {id(a): b for a, b in zip(self.frozen, self.frozen[1:], strict=False)}

    def is_last(self, unit: Unit) -> bool:
        return self.frozen is not None and self.frozen[-1] is unit


class ShardedState:
    """Everything flatshard keeps for one sharded model."""

    def __init__(
        self,
        units: list[Unit],
        *,
        topology: Topology,
        stats: CommStats,
        timeout: datetime.timedelta,
        prefetch: Prefetch,
        switches: Switches,
        max_inflight_reduces: int = 2,
        coalesce: Coalesce | None = None,
        root: torch.nn.Module | None = None,
    ) -> None:
        self.units = units
        self.topology = topology
        self.device = topology.device
        self.group = topology.shard_group  # parameters are sharded over it (None: not sharded)
        self.stats = stats
        self.timeout = timeout
        self.prefetch_policy = prefetch
        self.switches = switches  # the FLATSHARD_* switches read at fs.shard
        self.forward_order = StepOrder()
        self.backward_order = StepOrder()
        self.max_inflight_reduces = max_inflight_reduces
        self._inflight: deque[list[PendingReduce]] = deque()  # one entry per reduction
        self.coalesce = coalesce if coalesce is not None else Coalesce(unit_bytes=0)
        self.offloaded = any(g.offloaded for u in units for g in u.groups)
        self.root = root
        # The first forward's member calls, (unit, member) at first call: checks the buckets.
        self.member_order: list[tuple[Unit, int]] = []
        # The root's tail (see root_split.py) starts every backward: the last unit of the
        # forward is not the first of the backward then.
        self.tail_first = any(u.is_tail for u in units)
        self._ahead: dict[tuple[int, int, int], list[Unit]] = {}  # see ahead()
        self._reduced: list[PendingReduce] = []
        self.final_callback_queued = False
        self.mode = StateMode.TRAIN
        # Inside fs.pipeline_step(keep_gathered=True): see [Note: a stage kept gathered].
        self.keep_gathered = False
        self.tp: TPGroups | None = None  # if the model has tensor-parallel parameters
        # What fs.shard and helpers registered on the modules; fs.unshard removes them.
        self.handles: list = []
        self.gathered_bytes = GatheredBytes()
        for g in (g for u in units for g in u.groups if not g.replicated):
            g.account = self.gathered_bytes
        # Host gathers over Gloo only: see [Note: the pool only where it pays].
        pooled = switches.gather_pool and pays_off(topology)
        self.pool = self._gather_pool() if pooled else None

    def _gather_pool(self) -> GatherPool | None:
        """Reused gather buffers for the units that reshard after forward (enough for the
        current unit and those prefetched); with ``FLATSHARD_GATHER_POOL=0`` none: one buffer
        per unit, allocated at each gather and freed at each reshard."""
        pooled = [
            g for u in self.units
            if u.reshard_after_forward and not (u.regather_on_demand or u.merged)
            for g in u.groups
        ]  # fmt: skip
        # TP groups keep their own buffer: see [Note: tensor-parallel parameters]. A bucket
        # (merged unit) keeps its private one: its views are built once, not per pooled
        # buffer, and it needs no saved-tensor hooks (measured: 100 tiny units 1.67x -> 1.42x
        # unsharded).
        pooled = [g for g in pooled if not (g.replicated or g.has_tp)]
        if not pooled:
            return None
        pool = GatherPool(self.buffers_kept, self.gathered_bytes)
        for g in pooled:
            g.pool = pool
        return pool

    @property
    def buffers_kept(self) -> int:
        """Free buffers kept for reuse per kind (pool): the unit computing and those
        prefetched."""
        return max(2, self.prefetch_policy.forward + 1)

    def gathered_buffers(self) -> list[torch.Tensor]:
        """Every buffer that holds (or is kept for) gathered parameters now (accounting)."""
        groups = [g for u in self.units for g in u.groups if not (g.is_pooled or g.replicated)]
        out = [g.full for g in groups if g.full.untyped_storage().nbytes()]
        return out + (self.pool.buffers() if self.pool is not None else [])

    # ---- coalescing --------------------------------------------------------------------------
    def observe_member(self, unit: Unit, member: int) -> None:
        """A member call of the first forward (the order the buckets are checked against)."""
        if self.forward_order.frozen is None and all(
            u is not unit or i != member for u, i in self.member_order
        ):
            self.member_order.append((unit, member))

    def _check_bucket_order(self) -> None:
        """After the first iteration: did each bucket's members run one after another, in
        the modules' order?"""
        order = self.member_order
        position = {(id(u), i): at for at, (u, i) in enumerate(order)}
        for unit in (u for u in self.units if u.merged):
            places = [position.get((id(unit), i)) for i in range(len(unit.members))]
            if None in places or places != list(range(places[0], places[0] + len(places))):
                warnings.warn(bucket_order_message(unit, order), stacklevel=2)
        self.member_order = []

    def gather_for_step(self, unit: Unit) -> None:
        """The training hooks' gather."""
        self.ensure_gathered(unit)

    def ahead(self, order: StepOrder, unit: Unit, count: int = 1) -> list[Unit]:
        """The next ``count`` units after ``unit`` in ``order`` to prefetch (a bucket is one
        unit)."""
        key = (id(order), id(unit), count)
        if order.frozen is not None and key in self._ahead:
            return self._ahead[key]
        start = unit
        ahead: list[Unit] = []
        while len(ahead) < count and (unit := order.next_of.get(id(unit))) is not None:
            if unit.module is self.root and order is self.backward_order:
                continue  # gathered at the backward's start already, or on demand (lazy)
            ahead.append(unit)
        if order.frozen is not None:  # the same answer every step from now on
            self._ahead[(id(order), id(start), count)] = ahead
        return ahead

    # ---- gathering ---------------------------------------------------------------------------
    def ensure_gathered(self, unit: Unit) -> None:
        """Make ``unit``'s full buffers valid (regather if the shard changed since)."""
        if unit.state is ParamState.UNSHARDED and unit.is_stale():
            unit.reshard(self.timeout)
        unit.wait_gather(self.timeout)

    def prefetch(self, units: list[Unit]) -> None:
        for unit in units:
            unit.start_gather()

    def release(self, unit: Unit) -> None:
        """The training hooks' release of ``unit``'s full buffers: skipped while a pipeline
        step keeps the stage gathered ([Note: a stage kept gathered]), where only what a
        reshard drops per backward pass goes (a bucket's recompute views)."""
        if self.keep_gathered:
            unit.backward_views = None
        else:
            unit.reshard(self.timeout)

    def reshard_all(self) -> None:
        for unit in self.units:
            if self.mode is not StateMode.SUMMONED:
                unit.install_fragments()  # recompute views may still be installed
            unit.forward_pass = ForwardPass()  # a pass left open ends with the step
            if unit.state is not ParamState.SHARDED:
                self.release(unit)

    # ---- gradient reduction ------------------------------------------------------------------
    def launch_reduce(self, unit: Unit) -> None:
        """Start ``unit``'s reduction (``Unit.start_reduce``) and keep it in flight."""
        self._in_flight(unit.start_reduce(self.timeout))

    def _in_flight(self, pending: list[PendingReduce]) -> None:
        if not pending:
            return
        self._inflight.append(pending)
        # Bound the memory held by flat gradients still being reduced.
        while len(self._inflight) > self.max_inflight_reduces:
            self._finish_oldest_reduce()

    def _finish_oldest_reduce(self) -> None:
        for pending in self._inflight.popleft():
            pending.wait(self.timeout)
            self._reduced.append(pending)

    def finish_backward(self) -> None:
        """End of backward: reduce what never reduced, wait, agree on usage, assign grads."""
        self.final_callback_queued = False
        if self.mode.defers_reduction:  # flat gradients stay for the next micro-batch
            for unit in self.units:
                unit.grad.pending_nodes = 0
            self.reshard_all()
            return
        for unit in self.units:
            if unit.grad.pending_nodes > 0 or unit.has_unreduced_grads():
                unit.grad.pending_nodes = 0
                self.launch_reduce(unit)
        # Every reduction of this backward, in order: the waited ones, then those in flight.
        pending = [*self._reduced, *(r for group in self._inflight for r in group)]
        agreement = start_agreement([r.used for r in pending], self.topology, self.stats)
        while self._inflight:
            self._finish_oldest_reduce()
        reduced, self._reduced = self._reduced, []
        assert [id(r) for r in reduced] == [id(r) for r in pending]
        if reduced:
            used = agreement.used(self.timeout)  # see [Note: how usage is agreed]
            for r, used_globally in zip(reduced, used, strict=True):
                r.assign(used_globally, self.stats)
            if self.offloaded:  # the optimizer reads the gradients' host copies next
                offload.wait_for_host_copies(self.device)
        self.reshard_all()
        if self.forward_order.frozen is None:
            self.forward_order.freeze()
            self._check_bucket_order()
        self.backward_order.freeze()


STATE_ATTR = "_flatshard_state"  # where fs.shard keeps a model's ShardedState


def get_state(model: torch.nn.Module) -> ShardedState:
    """The ``ShardedState`` of a sharded model; ``ValueError`` if ``fs.shard`` was not called."""
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        raise ValueError(
            f"{type(model).__name__} is not sharded: call fs.shard(model) first and pass the "
            "module it returns"
        )
    return state
