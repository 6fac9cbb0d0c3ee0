"""Forward hooks of a merged unit's member modules (a bucket of coalesced units).

See [Note: coalesced units] in ``buckets.py``: a merged unit is one ``Unit`` whose pre- and
post-forward hooks sit on every member module; ``hooks.py`` hands member calls of a forward
here (calls during backward take the plain unit path), with the pieces of its own flow that
they share (``HookOps``: this module sits below ``hooks.py``), and asks
``defer_to_reentrant`` before it reduces a merged unit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from flatshard.core.state import ShardedState
from flatshard.core.unit import ForwardPass, Unit
from flatshard.features import recompute, saved_views
from flatshard.features.recompute import Call, CallKind


@dataclass(frozen=True)
class HookOps:
    """What a member call shares with a plain unit call (``hooks.py``'s functions)."""

    make_views: Callable[[ShardedState, Unit], tuple[list, Any]]
    enter_saved_views: Callable[[ShardedState, Unit], None]
    hook_output_grads: Callable[[ShardedState, Unit, Any], None]
    post_backward_on_inputs: Callable[[ShardedState, Unit, Any], None]


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


def post_forward(
    state: ShardedState, unit: Unit, module, inputs, output, call: Call, ops: HookOps
) -> None:
    """After a member's forward call: release the unit once every member ran in this pass
    and no member call is in progress."""
    saved_views.leave(unit)
    unit.forward_depth = max(0, unit.forward_depth - 1)
    fp = unit.forward_pass
    fp.ran.add(unit.member_position(module))
    if torch.is_grad_enabled() and unit.grad.pending_nodes > 0:
        ops.hook_output_grads(state, unit, output)
    if call.node is not None:
        if recompute.output_reaches(unit, output, call.node):
            fp.reached = True
        else:  # this call's gradients complete with its inputs' (see _post_forward)
            unit.grad.pending_nodes += 1
            ops.post_backward_on_inputs(state, unit, inputs)
    if unit.forward_depth > 0 or len(fp.ran) < len(unit.members):
        return
    if fp.node is not None and not fp.reached:  # no member's output leads to it: never runs
        unit.grad.pending_nodes = max(0, unit.grad.pending_nodes - 1)
    unit.forward_pass = ForwardPass()
    unit.install_fragments()
    last = state.forward_order.is_last(unit)  # the last bucket is kept whole into backward
    if unit.reshard_after_forward and not (last and torch.is_grad_enabled()):
        unit.reshard(state.timeout)
    if last and state.pool is not None:
        state.pool.trim()


def defer_to_reentrant(unit: Unit) -> bool:
    """A merged unit's nodes are all done, but a member whose forward ran under ``no_grad``
    (a reentrant checkpoint around it) has not been recomputed in this backward yet: its
    counted node, made then, reduces the unit (kept gathered meanwhile, as a reentrant
    recomputation is; the end of backward reduces and releases it if that never happens).
    See [Note: coalesced units] in ``buckets.py``."""
    return unit.merged and bool(unit.nograd_members) and recompute.in_backward()
