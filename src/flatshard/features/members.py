"""Forward hooks of a merged unit's member modules (a bucket of coalesced units).

See [Note: coalesced units] in ``buckets.py``: a merged unit is one ``Unit`` whose pre- and
post-forward hooks sit on every member module. ``hooks.py`` opens member calls of a forward
here (``pre_forward``, with the pieces of its own flow they share: ``HookOps``, as this module
sits below ``hooks.py``); its one post-forward (see [Note: one post-forward] in ``hooks.py``)
asks ``end_call`` whether the bucket's forward pass is over; and ``defer_to_reentrant`` is
asked before a merged unit reduces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flatshard.core.state import ShardedState
from flatshard.core.unit import ForwardPass, Unit
from flatshard.features import recompute
from flatshard.features.recompute import Call, CallKind


@dataclass(frozen=True)
class HookOps:
    """What a member call shares with a plain unit call (``hooks.py``'s functions)."""

    make_views: Callable[[ShardedState, Unit], tuple[list, Any]]
    enter_saved_views: Callable[[ShardedState, Unit], None]


def pre_forward(state: ShardedState, unit: Unit, member: int, ops: HookOps) -> None:
    """A forward call of one member of a merged unit (see [Note: coalesced units]): the
    first of a pass gathers and installs every member's views; the first with grad makes the
    pass's counted node."""
    fp = unit.forward_pass
    if unit.forward_depth == 0 and member in fp.ran:  # the last pass left a member out
        fp.started = False
    first = not fp.started
    if first:
        fp = unit.start_forward_pass()
        unit.nograd_members = set()
        state.forward_order.observe(unit)
    if not torch.is_grad_enabled():
        unit.nograd_members.add(member)  # a reentrant checkpoint recomputes it in backward?
    state.gather_for_step(unit)
    if first:
        state.prefetch(state.ahead(state.forward_order, unit, state.prefetch_policy.forward))
    ops.enter_saved_views(state, unit)
    if first or (fp.node is None and torch.is_grad_enabled()):
        views, node = ops.make_views(state, unit)
        unit.install_views(views)
        fp.node = fp.node if node is None else node
    unit.forward_depth += 1
    unit.calls.append(Call(CallKind.FORWARD, fp.node))


def end_call(unit: Unit, module: nn.Module) -> bool:
    """A member's forward call is over: is the bucket's forward pass over too (every member
    ran, no member call in progress)? Then the pass's node keeps its count only if some
    member's output reached it (see ``hooks._settle_node``), and the next call starts a new
    pass."""
    fp = unit.forward_pass
    fp.ran.add(unit.member_position(module))
    if unit.forward_depth > 0 or len(fp.ran) < len(unit.members):
        return False
    if fp.node is not None and not fp.reached:  # no member's output leads to it: never runs
        unit.grad.pending_nodes = max(0, unit.grad.pending_nodes - 1)
    unit.forward_pass = ForwardPass()
    return True


def defer_to_reentrant(unit: Unit) -> bool:
    """A merged unit's nodes are all done, but a member whose forward ran under ``no_grad``
    (a reentrant checkpoint around it) has not been recomputed in this backward yet: its
    counted node, made then, reduces the unit (kept gathered meanwhile, as a reentrant
    recomputation is; the end of backward reduces and releases it if that never happens).
    See [Note: coalesced units] in ``buckets.py``."""
    return unit.merged and bool(unit.nograd_members) and recompute.in_backward()
