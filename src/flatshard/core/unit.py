"""One unit: a module whose parameters are gathered and released together.

A unit holds one ``FlatGroup`` per (dtype, requires_grad) of the parameters it owns, the list of
places (module, attribute name) where each of those parameters is registered, and its state.

[Note: parameter swapping]
At rest every place holds the parameter's sharded fragment, so ``model.parameters()`` and the
optimizer see fragments. While the unit is in use (its forward, its backward, a summon), each
place holds a full-shape view of the gathered buffer instead. Writing ``module._parameters``
directly (not ``setattr``) is deliberate: the views are plain tensors, not ``nn.Parameter``s,
and must not be registered as new parameters.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from flatshard.comm.collectives import CommStats, PendingWork
from flatshard.core.flat_group import FlatGroup
from flatshard.core.gather import start_gather
from flatshard.core.mesh import Topology
from flatshard.core.reduce import (
    PendingReduce,
    flat_grad_from,
    reduce_group,
    reduces_pieces,
    zeros_flat_grad,
)
from flatshard.features.float8 import float8_dtype_of, set_scales
from flatshard.offload import CPUOffload
from flatshard.parallel.tensor import wrap_views
from flatshard.precision import MixedPrecision


class UnitRole(enum.Enum):
    """What a unit is to its model (see root_split.py and lazy_root.py)."""

    BLOCK = "block"  # a module the policy chose
    ROOT = "root"  # the root module's own parameters (gathered from forward into backward)
    LAZY_ROOT = "lazy_root"  # the root, its tail split off: released after forward, regathered
    # in backward only on demand ([Note: the lazy root])
    TAIL = "tail"  # the root's parameters used only after the last unit (final norm, head)


class ParamState(enum.Enum):
    SHARDED = "sharded"  # only fragments in memory
    GATHERING = "gathering"  # an async all-gather is writing the full buffers
    UNSHARDED = "unsharded"  # full buffers valid


@dataclass
class Slot:
    """One place where a parameter is registered: ``module._parameters[name]``."""

    module: nn.Module
    name: str
    group: int
    index: int


@dataclass
class Member:
    """One module of a unit: ``index`` is its position in the wrap plan (``fs.units``);
    for a bucket's member (see [Note: coalesced units]) what it was as a unit of its own."""

    module: nn.Module
    index: int
    full_bytes: int = 0  # its own parameters gathered alone (what Coalesce.unit_bytes compares)
    params: frozenset[int] = frozenset()  # ids of the parameters it owns (empty: all of them)


@dataclass
class ForwardPass:
    """A merged unit's forward pass in progress: which members ran, and its counted node."""

    started: bool = False
    ran: set[int] = field(default_factory=set)
    node: Any = None  # the counted UnitViews node of this pass (made with grad enabled)
    reached: bool = False  # some member's output depends on ``node`` (so it will run)


@dataclass
class GradState:
    """Per-backward gradient bookkeeping of one unit."""

    pending_nodes: int = 0  # autograd nodes created in forward whose backward has not run
    # Per group: the flat gradient, or the per-parameter gradients themselves when they are
    # reduced without a flat copy (``reduce.reduces_pieces``), or None before any.
    flat_grads: list[torch.Tensor | tuple | None] = field(default_factory=list)
    used: list[list[bool]] = field(default_factory=list)  # per group: bool per parameter


class Unit:
    """Parameters of one wrapped module, sharded as flat groups."""

    def __init__(
        self,
        index: int,
        module: nn.Module,
        params: list[nn.Parameter],
        slots_by_param: dict[int, list[tuple[nn.Module, str]]],
        *,
        topology: Topology,
        stats: CommStats,
        reshard_after_forward: bool,
        mixed_precision: MixedPrecision | None = None,
        offload: CPUOffload | None = None,
        role: UnitRole = UnitRole.BLOCK,
        members: list[Member] | None = None,
    ) -> None:
        self.index = index
        self.role = role
        self.module = module  # the first member's module (see [Note: coalesced units])
        # A bucket's modules, each with its pre/post-forward hooks; one for a plain unit.
        self.members = members if members is not None else [Member(module, index)]
        self.merged = len(self.members) > 1
        self.bucket: int | None = None  # the bucket's index when merged (fs.units reports it)
        self.process_group = topology.shard_group
        self.topology = topology
        self.stats = stats
        self.reshard_after_forward = reshard_after_forward
        device = topology.device
        self._build_groups(params, slots_by_param, mixed_precision, offload)
        self.trainable_groups = [i for i, g in enumerate(self.groups) if g.requires_grad]
        self.has_tp = any(g.has_tp for g in self.groups)
        self.float8_groups = [g for g in self.groups if g.float8 is not None]
        # Extra inputs of ``UnitViews`` inside fs.pipeline_step ([Note: fragments in the graph]).
        self.trainable_fragments = [
            s.fragment for gi in self.trainable_groups for s in self.groups[gi].specs
        ]
        # A zero-size leaf that makes autograd call ``UnitViews.backward`` (see hooks.py).
        self.anchor = torch.empty(0, device=device, requires_grad=True)
        self.state = ParamState.SHARDED
        self.forward_depth = 0  # nested calls in progress (a registered method calling forward)
        self.saved_hooks: list = []  # per forward call in progress, see saved_views.enter
        self.calls: list = []  # per forward call in progress: a recompute.Call
        self._gather_work: list[PendingWork] = []
        self.forward_pass = ForwardPass()  # a merged unit's current forward pass
        self.nograd_members: set[int] = set()  # see hooks.defer_to_reentrant
        self.backward_views: list | None = None  # a merged unit's recompute views, this gather
        # The lazy root (see lazy_root.py): ``lazy_now``: this step's forward could install
        # its saved-tensor hooks.
        self.reach_calls = self.reach_streak = 0  # see recompute.output_reaches
        self.lazy_now = False
        self.on_demand_views: list | None = None  # this backward's, once a placeholder was used
        self._gathered_versions: list[int] = []
        self.grad = GradState()
        self.reset_grad_state()
        self.install_fragments()

    def _build_groups(self, params, slots_by_param, mixed_precision, offload) -> None:
        """One flat group per (dtype, requires_grad) of ``params``, and their places."""
        self.groups: list[FlatGroup] = []
        self.slots: list[Slot] = []
        # Per group, the ids of the parameters it was built from (a member's, see fs.units).
        self.built_from: list[list[int]] = []
        for members in _group_by_kind(params).values():
            self.built_from.append([id(p) for p in members])
            label = f"unit {self.index} ({type(self.module).__name__}) group {len(self.groups)}"
            self._add_group(members, slots_by_param, label, mixed_precision, offload)

    def _add_group(self, members, slots_by_param, label, mixed_precision, offload) -> None:
        """One flat group of ``members`` (same dtype and requires_grad), and their places."""
        topo, gi = self.topology, len(self.groups)
        self.groups.append(
            FlatGroup(
                members,
                rank=topo.shard_rank,
                world=topo.shard_world,
                device=topo.device,
                mixed_precision=mixed_precision,
                offload=offload,
                label=label,
            )
        )
        for pi, p in enumerate(members):
            for module, name in slots_by_param[id(p)]:
                self.slots.append(Slot(module, name, gi, pi))

    @property
    def regather_on_demand(self) -> bool:
        """The lazy root: regathered in backward only when something reads it."""
        return self.role is UnitRole.LAZY_ROOT

    @property
    def is_tail(self) -> bool:
        return self.role is UnitRole.TAIL

    def reset_grad_state(self) -> None:
        """After this unit's reduction is launched (or a no_sync backward): the autograd graph
        of its forward calls is gone, so gathers may borrow pooled buffers again."""
        for g in self.groups:
            g.keep_private = False
        self.on_demand_views = None
        self.grad.pending_nodes = 0
        self.grad.flat_grads = [None] * len(self.groups)
        self.grad.used = [[False] * len(g.specs) for g in self.groups]

    def has_unreduced_grads(self) -> bool:
        """Flat gradients accumulated under ``no_sync`` that still await their reduction."""
        return any(g is not None for g in self.grad.flat_grads)

    # ---- parameter placement -----------------------------------------------------------------
    def install_fragments(self) -> None:
        for slot in self.slots:
            slot.module._parameters[slot.name] = self.groups[slot.group].specs[slot.index].fragment

    def install_views(self, views: list[list[torch.Tensor]]) -> None:
        for slot in self.slots:
            slot.module._parameters[slot.name] = views[slot.group][slot.index]

    def views_in_place(self, views: list[list[torch.Tensor]]) -> bool:
        """Are ``views`` installed (every place is set at once, so the first one tells)?"""
        slot = self.slots[0]
        return slot.module._parameters[slot.name] is views[slot.group][slot.index]

    def as_parameters(self, views: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Full views as the module's parameters: tensor-parallel ones as their DTensors
        (see [Note: tensor-parallel parameters] in parallel/tensor.py)."""
        if not self.has_tp:
            return views
        return wrap_views(views, [g.tp for g in self.groups])

    def replaced_parameter(self) -> str | None:
        """The first place whose parameter is no longer this unit's fragment (something
        registered a new parameter after ``fs.shard``), as ``Module.name``; None if none."""
        for slot in self.slots:
            if (
                slot.module._parameters.get(slot.name)
                is not self.groups[slot.group].specs[slot.index].fragment
            ):
                return f"{type(slot.module).__name__}.{slot.name}"
        return None

    # ---- gather / release --------------------------------------------------------------------
    def start_gather(self) -> None:
        """Issue the async all-gathers of every group (no-op unless sharded)."""
        if self.state is not ParamState.SHARDED:
            return
        topo, stats = self.topology, self.stats
        if self.float8_groups:  # one amax all-reduce per unit (see [Note: float8 all-gather])
            set_scales(self.float8_groups, topo, stats)
        self.mark_gathering([start_gather(g, topo, stats, g.label) for g in self.groups])

    def mark_gathering(self, works: list[PendingWork]) -> None:
        """The gathers of every group are in flight (``works``)."""
        self._gather_work = works
        self._gathered_versions = [g.shard._version for g in self.groups]
        self.state = ParamState.GATHERING

    def is_stale(self) -> bool:
        """True if a shard changed in place (optimizer step, load) since it was gathered."""
        return any(
            g.shard._version != v for g, v in zip(self.groups, self._gathered_versions, strict=True)
        )

    def wait_gather(self, timeout) -> None:
        self.start_gather()
        if self.state is ParamState.GATHERING:
            for work in self._gather_work:
                work.wait(timeout)
            self._gather_work = []
            self.state = ParamState.UNSHARDED

    def reshard(self, timeout) -> None:
        """Release the full buffers (fragments stay)."""
        if self.state is ParamState.GATHERING:
            self.wait_gather(timeout)
        for g in self.groups:
            g.free_full()
        self.state = ParamState.SHARDED
        self.backward_views = None

    def member_position(self, module: nn.Module) -> int:
        """Which member ``module`` is (0 for a module that is none: ``register_method``)."""
        return next((i for i, m in enumerate(self.members) if m.module is module), 0)

    def start_forward_pass(self) -> ForwardPass:
        """A new forward pass of a merged unit (every member may run once more)."""
        self.forward_pass = ForwardPass(started=True)
        return self.forward_pass

    # ---- gradient accumulation and reduction ---------------------------------------------------
    def accumulate(self, grads: tuple, *, reduce_now: bool) -> None:
        """Add one autograd node's per-parameter gradients (``None``: unused by that call).
        ``reduce_now``: they are the last before this unit's reduction, so a group whose
        gradient can be sent from its pieces keeps them as they are (no flat copy)."""
        offset = 0
        for gi in self.trainable_groups:
            group = self.groups[gi]
            mine = grads[offset : offset + len(group.specs)]
            offset += len(group.specs)
            if all(g is None for g in mine):
                continue
            previous = self.grad.flat_grads[gi]
            # A bucket's parameters are small (its members are at most Coalesce.unit_bytes):
            # one message per parameter would cost more than the flat copy.
            pieces = (
                reduce_now and not self.merged and reduces_pieces(group, self.topology, self.stats)
            )
            if previous is None and pieces:
                self.grad.flat_grads[gi] = tuple(mine)  # reduced without a flat copy
            else:
                flat = flat_grad_from(group, mine)
                self.grad.flat_grads[gi] = flat if previous is None else previous.add_(flat)
            used = self.grad.used[gi]
            for i, g in enumerate(mine):
                used[i] = used[i] or g is not None

    def start_reduce(self, timeout) -> list[PendingReduce]:
        """Start averaging each trainable group's gradient over the data-parallel ranks, each
        group a bucket of one (see reduce.py; zeros for a group no call used: every rank must
        issue the same collectives)."""
        topo, stats = self.topology, self.stats
        return [reduce_group(*m, topo, stats, timeout) for m in self.take_flat_grads()]

    def take_flat_grads(self) -> list[tuple[FlatGroup, torch.Tensor | tuple, torch.Tensor]]:
        """(group, flat gradient, used mask) per trainable group, zeros for a group no call
        used (every rank must issue the same collectives); the unit's gradients reset."""
        out = []
        for gi in self.trainable_groups:
            group, flat = self.groups[gi], self.grad.flat_grads[gi]
            used = torch.tensor(self.grad.used[gi], dtype=torch.bool)
            out.append((group, zeros_flat_grad(group) if flat is None else flat, used))
        self.reset_grad_state()
        return out


def _group_by_kind(params: list[nn.Parameter]) -> dict[tuple, list[nn.Parameter]]:
    """Split a unit's parameters by (dtype, requires_grad, float8 all-gather dtype), keeping
    their order (torchao's float8 weights form groups of their own: [Note: float8 all-gather])."""
    kinds: dict[tuple, list[nn.Parameter]] = {}
    for p in params:
        kinds.setdefault((p.dtype, p.requires_grad, float8_dtype_of(p)), []).append(p)
    return kinds
