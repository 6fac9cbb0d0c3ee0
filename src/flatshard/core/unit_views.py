"""One autograd node per unit call: the views it hands out, and its backward (post-backward).

[Note: one autograd node per unit call]
``UnitViews`` returns every full-shape parameter view of the unit's trainable groups, so its
backward receives all their gradients at once, ``None`` exactly for parameters this call did
not use. That single callback is both the post-backward hook (no per-parameter hooks, no
AccumulateGrad tricks) and the usage detector for unused parameters. The forward hooks that
make these nodes are in ``hooks.py``.

[Note: fragments in the graph]
Inside ``fs.pipeline_step`` ``UnitViews`` also takes the unit's trainable fragments as inputs,
which makes them leaves of the autograd graph, as an unsharded module's parameters are: the
split-backward schedules run their weight pass as ``autograd.grad`` from saved intermediates
*to the stage's parameters* (``pipelining/_backward.py``), and that pass is what runs the
units' nodes then. The fragments get zeros (the real gradients arrive reduced when the step
ends); the saved views such a late pass unpacks regather their unit on demand
(``saved_views.enter_regathering``). Outside ``pipeline_step`` the node has no such inputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd import Variable

from flatshard.core.state import ShardedState, StateMode
from flatshard.core.unit import Unit
from flatshard.features import members


class UnitViews(torch.autograd.Function):
    """Hands out full-shape views of a unit's gathered buffers; its backward is post-backward.

    ``counted``: the node of a forward call, whose backward the unit waits for before it
    reduces (``GradState.pending_nodes``). Uncounted nodes hand out the views of a
    recomputation (see [Note: recomputation] in ``recompute.py``): their backward only runs
    when a reentrant checkpoint backpropagates through the recomputed graph, and then adds
    its gradients to the unit's."""

    @staticmethod
    def forward(
        ctx, anchor: torch.Tensor, state: ShardedState, unit: Unit, counted: bool, *fragments
    ):  # type: ignore[override]
        del anchor  # only there so that autograd calls backward
        ctx.state, ctx.unit, ctx.counted = state, unit, counted
        ctx.fragments = len(fragments)  # see [Note: fragments in the graph]
        ctx.set_materialize_grads(False)
        return tuple(v for gi in unit.trainable_groups for v in unit.groups[gi].full_views())

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        if ctx.counted:
            on_unit_grads(ctx.state, ctx.unit, grads)
        else:
            accumulate_grads(ctx.state, ctx.unit, grads, final=False)
        # Zeros for the fragments (the real gradients arrive reduced, when the step ends).
        zeros = [torch.zeros_like(f) for f in ctx.unit.trainable_fragments[: ctx.fragments]]
        return None, None, None, None, *zeros


def make_views(
    state: ShardedState, unit: Unit, *, counted: bool = True
) -> tuple[list[list[torch.Tensor]], Any]:
    """Full-shape views per group, autograd-connected when a backward may follow; and the
    ``UnitViews`` node they come from (None without one)."""
    trainable = unit.trainable_groups
    if not (trainable and torch.is_grad_enabled()):
        return unit.as_parameters([g.full_views() for g in unit.groups]), None
    leaves = unit.trainable_fragments if state.mode is StateMode.PIPELINE else ()
    outs = UnitViews.apply(unit.anchor, state, unit, counted, *leaves)
    it = iter(outs)
    views = [
        [next(it) for _ in g.specs] if g.requires_grad else g.full_views() for g in unit.groups
    ]
    if counted:
        unit.grad.pending_nodes += 1
    return unit.as_parameters(views), outs[0].grad_fn


def recompute_views(state: ShardedState, unit: Unit) -> list[list[torch.Tensor]]:
    """Full views for a forward recomputed in backward (activation checkpointing): outputs of
    an uncounted ``UnitViews`` node, so the recomputed ops save exactly the tensors the first
    forward saved, and a reentrant checkpoint's nested backward hands their gradients to the
    unit. Installed by every pre-backward: a recomputation inside the unit's own forward code
    fires no hook of ours."""
    with torch.enable_grad():
        return make_views(state, unit, counted=False)[0]


def accumulate_grads(state: ShardedState, unit: Unit, grads: tuple, *, final: bool) -> None:
    """Add one node's per-parameter gradients to the unit's. ``final``: the node of a forward
    call (not a recomputation's), which may be the last before the unit reduces."""
    queue_final_callback(state)
    reduce_now = final and _reduce_right_away(state, unit)
    unit.accumulate(grads, reduce_now=reduce_now)


def on_unit_grads(state: ShardedState, unit: Unit, grads: tuple) -> None:
    """Post-backward of one unit call: accumulate its gradients; reduce after the last call."""
    accumulate_grads(state, unit, grads, final=True)
    call_done(state, unit)


def call_done(state: ShardedState, unit: Unit) -> None:
    """One forward call's backward is over; after the last one, reduce and reshard."""
    queue_final_callback(state)
    unit.grad.pending_nodes = max(0, unit.grad.pending_nodes - 1)
    if unit.grad.pending_nodes == 0 and members.defer_to_reentrant(unit):
        unit.install_fragments()  # kept gathered for that member's recomputation
    elif unit.grad.pending_nodes == 0:
        if not state.mode.defers_reduction:
            state.launch_reduce(unit)
        unit.install_fragments()
        state.release(unit)  # not inside fs.pipeline_step(keep_gathered=True)
        if state.prefetch_policy.backward == "post":
            state.prefetch(state.ahead(state.backward_order, unit))


def _reduce_right_away(state: ShardedState, unit: Unit) -> bool:
    """This call's gradients are the unit's last of this backward and get reduced next."""
    return (
        unit.grad.pending_nodes == 1
        and not state.mode.defers_reduction
        and not members.defer_to_reentrant(unit)
    )


def queue_final_callback(state: ShardedState) -> None:
    """Queue the end of backward (``state.finish_backward``) once per backward pass."""
    if not state.final_callback_queued:
        state.final_callback_queued = True
        Variable._execution_engine.queue_callback(state.finish_backward)
