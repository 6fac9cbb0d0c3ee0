"""Forward/backward hooks: the training-state machine of every unit.

Flow per unit and iteration:
  pre-forward   gather (or wait for the prefetched gather), prefetch the next unit, install
                full-shape views; with grad enabled the views come out of one ``UnitViews``
                autograd node per unit call
  post-forward  reinstall fragments, reshard (full_shard), hook the outputs' gradients
  pre-backward  (first gradient reaching an output) gather again, prefetch the next unit,
                install recompute views (see [Note: recomputation] in ``recompute.py``)
  post-backward ``UnitViews.backward`` runs once all of this call's parameter gradients exist:
                flatten them, and when the unit's last forward call is accounted for,
                reduce-scatter and reshard
  end of backward  (one queued autograd callback) reduce units whose node never ran, wait,
                agree across ranks on which parameters were used, assign ``.grad``
A bucket of coalesced units is one unit whose hooks sit on several modules: its members'
forward calls go through ``members.py`` (one pass, one node; see [Note: coalesced units]).

[Note: fragments in the graph]
Inside ``fs.pipeline_step`` ``UnitViews`` also takes the unit's trainable fragments as inputs,
which makes them leaves of the autograd graph, as an unsharded module's parameters are: the
split-backward schedules run their weight pass as ``autograd.grad`` from saved intermediates
*to the stage's parameters* (``pipelining/_backward.py``), and that pass is what runs the
units' nodes then. The fragments get zeros (the real gradients arrive reduced when the step
ends); the saved views such a late pass unpacks regather their unit on demand
(``saved_views.enter_regathering``). Outside ``pipeline_step`` the node has no such inputs.

[Note: one autograd node per unit call]
``UnitViews`` returns every full-shape parameter view of the unit's trainable groups, so its
backward receives all their gradients at once, ``None`` exactly for parameters this call did
not use. That single callback is both the post-backward hook (no per-parameter hooks, no
AccumulateGrad tricks) and the usage detector for unused parameters.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten

from flatshard.core.state import ShardedState, StateMode
from flatshard.core.unit import ParamState, Unit
from flatshard.features import lazy_root, members, recompute, saved_views
from flatshard.features.compile_boundary import register_plain_keys, register_settling, untraced
from flatshard.features.recompute import Call, CallKind
from flatshard.precision import MixedPrecision, cast_floating


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


def register_hooks(state: ShardedState) -> list[Any]:
    """Every unit's forward hooks, which Dynamo never traces (see [Note: hooks the compiler
    never traces] in ``compile_boundary.py``), and the root's plain state-dict keys."""
    handles = register_plain_keys(state.root) if state.root is not None else []
    for unit, module in ((u, m.module) for u in state.units for m in u.members):
        handles.append(
            module.register_forward_pre_hook(
                untraced(partial(_pre_forward, state, unit)), with_kwargs=True, prepend=True
            )
        )
        handles.append(
            module.register_forward_hook(
                untraced(partial(_post_forward, state, unit)), with_kwargs=True, always_call=True
            )
        )
    if state.tp is not None:  # see [Note: async tensors at a compiled unit's door]
        handles += register_settling([m.module for unit in state.units for m in unit.members])
    return handles


def register_precision_casts(model: nn.Module, mp: MixedPrecision) -> list[Any]:
    """Cast the root's floating inputs to ``param_dtype`` and outputs to ``output_dtype``
    (untraced as every hook of ours: they sit next to the root unit's, see hooks.py)."""
    handles = []
    if mp.cast_forward_inputs and mp.param_dtype is not None:

        def cast_inputs(module, args, kwargs):
            return cast_floating(args, mp.param_dtype), cast_floating(kwargs, mp.param_dtype)

        handles.append(model.register_forward_pre_hook(untraced(cast_inputs), with_kwargs=True))
    if mp.output_dtype is not None:

        def cast_output(module, args, output):
            return cast_floating(output, mp.output_dtype)

        handles.append(model.register_forward_hook(untraced(cast_output)))
    return handles


def _pre_forward(state: ShardedState, unit: Unit, module, args, kwargs):
    if state.mode is StateMode.SUMMONED:  # full parameters installed; no collective may run
        return None
    kind = recompute.classify_call(unit)
    # Until the first backward ends (the step order is frozen then): not a per-step cost. A
    # merged unit's pass in progress has its other members' views in place.
    first_step = kind is CallKind.FORWARD and state.forward_order.frozen is None
    if first_step and unit.forward_depth == 0 and not unit.forward_pass.started:
        _check_fragments_in_place(unit)
    if unit.is_tail and kind is CallKind.FORWARD:
        return _pre_forward_tail(state, unit)
    member = unit.member_position(module)
    if first_step:
        state.observe_member(unit, member)
    if unit.merged and kind is CallKind.FORWARD:
        return members.pre_forward(state, unit, member, _OPS)
    if unit.merged:  # in backward: this member's forward is recomputed now
        unit.nograd_members.discard(member)
    state.gather_for_step(unit)
    if kind is CallKind.RECOMPUTE:  # gradients flow through the first forward's graph
        unit.install_views(recompute_views(state, unit))
        unit.calls.append(Call(kind))
        return None
    if kind is CallKind.FORWARD:
        state.forward_order.observe(unit)
        state.prefetch(state.ahead(state.forward_order, unit, state.prefetch_policy.forward))
    _enter_saved_views(state, unit)
    views, node = make_views(state, unit)
    unit.install_views(views)
    unit.forward_depth += 1
    unit.calls.append(Call(kind, node))
    return None


def _enter_saved_views(state: ShardedState, unit: Unit) -> None:
    if unit.regather_on_demand:  # see [Note: the lazy root]
        unit.lazy_now = lazy_root.enter(unit, partial(state.gather_for_step, unit))
    elif state.mode is StateMode.PIPELINE:  # see [Note: fragments in the graph]
        saved_views.enter_regathering(unit, partial(state.gather_for_step, unit))
    else:
        saved_views.enter(state.pool, unit)


def _check_fragments_in_place(unit: Unit) -> None:
    """At rest every place holds its fragment; a parameter registered over one after
    ``fs.shard`` (typically a tensor-parallel plan applied between ``fs.shard`` and training)
    would be silently overwritten by the gathered views. Checked in the first step only."""
    replaced = unit.replaced_parameter()
    if replaced is not None:
        raise RuntimeError(
            f"flatshard: parameter {replaced} of unit {unit.index} was replaced after fs.shard "
            "(parallelize_module after sharding does this: it registers new DTensor "
            "parameters); apply parallelize_module, and any other change of parameters, "
            "before fs.shard"
        )


def _pre_forward_tail(state: ShardedState, unit: Unit) -> None:
    """The root's tail: its gather is started, and its views (with their ``UnitViews`` node)
    made at the first use of one of its parameters, behind the blocks: autograd runs the ready
    node with the highest sequence number first, so a node made at the root's pre-forward
    would run after every block's, at the very end of backward, and the tail would reduce
    last (see [Note: the root's tail]). Until then its places hold placeholders."""
    state.forward_order.observe(unit)
    unit.start_gather()
    call = Call(CallKind.FORWARD, grad_enabled=torch.is_grad_enabled())
    unit.calls.append(call)
    unit.forward_depth += 1
    saved_views.enter(None, unit)  # keeps saved_hooks paired with _post_forward's leave
    # Resolved from inside a compiled forward too: never traced (see [Note: hooks the
    # compiler never traces]).
    views = untraced(partial(_tail_views, state, unit, call))
    unit.install_views(lazy_root.placeholders(unit, views))


def _tail_views(state: ShardedState, unit: Unit, call: Call) -> list[list[torch.Tensor]]:
    if call.views is None:
        state.ensure_gathered(unit)
        # The grad mode of the forward call, not of the first use (a reentrant checkpoint runs
        # it under no_grad): the node must exist for the output hooks and the usage check.
        with torch.set_grad_enabled(call.grad_enabled):
            call.views, call.node = make_views(state, unit)
        unit.install_views(call.views)
    return call.views


def _post_forward(state: ShardedState, unit: Unit, module, args, kwargs, output):
    if state.mode is StateMode.SUMMONED:
        return None
    call = unit.calls.pop() if unit.calls else Call(CallKind.FORWARD)
    unused_tail = unit.is_tail and call.kind is CallKind.FORWARD and call.views is None
    if unused_tail and unit.state is not ParamState.SHARDED:  # (sharded: its gather failed)
        _tail_views(state, unit, call)  # unused in this forward: its node must exist all the same
    if call.kind is CallKind.RECOMPUTE:  # views stay until this unit's post-backward
        return None
    if unit.merged and call.kind is CallKind.FORWARD:
        return members.post_forward(state, unit, module, (args, kwargs), output, call, _OPS)
    saved_views.leave(unit)
    unit.forward_depth = max(0, unit.forward_depth - 1)
    if unit.forward_depth == 0:  # not inside an outer call of the same unit (register_method)
        unit.install_fragments()
        # The last unit of the forward is the first of the backward: keep it (one regather
        # less per step). Only with grad: a no-grad forward has no backward to wait for. A
        # reentrant recomputation is backpropagated right away: keep it too.
        # With the root's tail split off, the tail's backward comes first and prefetches the
        # last unit behind the head's backward: it need not be held through the loss.
        last = state.forward_order.is_last(unit)
        keep_last = last and not state.tail_first
        keep = call.kind is CallKind.REENTRANT or (keep_last and torch.is_grad_enabled())
        if unit.reshard_after_forward and not keep:
            unit.reshard(state.timeout)
        if last and state.pool is not None and call.kind is CallKind.FORWARD:
            state.pool.trim()
    if torch.is_grad_enabled() and unit.grad.pending_nodes > 0:
        _hook_output_grads(state, unit, output)
    if call.node is not None and not recompute.output_reaches(unit, output, call.node):
        # Nothing of the output depends on the views (a reentrant checkpoint inside the
        # unit ran them under no_grad): this call's node will never run; its gradients come
        # from the recomputation, and the unit's inputs tell when they are complete.
        _post_backward_on_inputs(state, unit, (args, kwargs))
    return None


PRE_BACKWARD = "_flatshard_pre_backward"  # on an output: [(hook handle, state, unit), ...]


def _hook_output_grads(state: ShardedState, unit: Unit, output) -> None:
    tensors, _ = tree_flatten(output)
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            handle = t.register_hook(partial(_pre_backward, state, unit))
            hooked = getattr(t, PRE_BACKWARD, None)
            setattr(t, PRE_BACKWARD, [*(hooked or ()), (handle, state, unit)])


def _post_backward_on_inputs(state: ShardedState, unit: Unit, inputs) -> None:
    """This call's post-backward fires once its inputs' gradients are complete. An input is
    usually the output of the unit before: that unit's pre-backward hook, registered earlier on
    the same tensor, would run first (hooks run in registration order) and gather it while this
    one is still gathered; so it is moved behind ours."""
    tensors = recompute.post_backward_on_inputs(inputs, partial(_call_done, state, unit))
    for t in tensors:
        hooked = getattr(t, PRE_BACKWARD, None) or []
        for handle, _, _ in hooked:
            handle.remove()
        setattr(t, PRE_BACKWARD, [])
        for _, owner, other in hooked:
            _hook_output_grads(owner, other, t)


def _pre_backward(state: ShardedState, unit: Unit, grad: torch.Tensor) -> None:
    _queue_final_callback(state)
    state.backward_order.observe(unit)
    if unit.lazy_now and unit.state is ParamState.SHARDED:  # see [Note: the lazy root]
        unit.on_demand_views = None
        views = untraced(partial(_on_demand_views, state, unit))
        unit.install_views(lazy_root.placeholders(unit, views))
        return
    if unit.backward_views is not None and unit.state is ParamState.UNSHARDED:
        if not unit.views_in_place(unit.backward_views):  # another member's: one node a gather
            unit.install_views(unit.backward_views)
        return
    state.gather_for_step(unit)
    if state.prefetch_policy.backward == "pre":
        state.prefetch(state.ahead(state.backward_order, unit))
    views = recompute_views(state, unit)
    unit.backward_views = views if unit.merged else None
    unit.install_views(views)


def _on_demand_views(state: ShardedState, unit: Unit) -> list[list[torch.Tensor]]:
    """A placeholder of the lazy root was used: gather it, install real recompute views (the
    next uses read them directly) and hand them out."""
    if unit.on_demand_views is None:
        state.gather_for_step(unit)
        unit.on_demand_views = recompute_views(state, unit)
        unit.install_views(unit.on_demand_views)
    return unit.on_demand_views


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
    _queue_final_callback(state)
    reduce_now = final and _reduce_right_away(state, unit)
    unit.accumulate(grads, reduce_now=reduce_now)


def on_unit_grads(state: ShardedState, unit: Unit, grads: tuple) -> None:
    """Post-backward of one unit call: accumulate its gradients; reduce after the last call."""
    accumulate_grads(state, unit, grads, final=True)
    _call_done(state, unit)


def _call_done(state: ShardedState, unit: Unit) -> None:
    """One forward call's backward is over; after the last one, reduce and reshard."""
    _queue_final_callback(state)
    unit.grad.pending_nodes = max(0, unit.grad.pending_nodes - 1)
    if unit.grad.pending_nodes == 0 and members.defer_to_reentrant(unit):
        unit.install_fragments()  # kept gathered for that member's recomputation
    elif unit.grad.pending_nodes == 0:
        if not state.mode.defers_reduction:
            state.launch_reduce(unit)
        unit.install_fragments()
        unit.reshard(state.timeout)
        if state.prefetch_policy.backward == "post":
            state.prefetch(state.ahead(state.backward_order, unit))


def _reduce_right_away(state: ShardedState, unit: Unit) -> bool:
    """This call's gradients are the unit's last of this backward and get reduced next."""
    return (
        unit.grad.pending_nodes == 1
        and not state.mode.defers_reduction
        and not members.defer_to_reentrant(unit)
    )


# What a bucket's member calls share with a plain unit call (see members.py).
_OPS = members.HookOps(make_views, _enter_saved_views, _hook_output_grads, _post_backward_on_inputs)


def _queue_final_callback(state: ShardedState) -> None:
    if not state.final_callback_queued:
        state.final_callback_queued = True
        Variable._execution_engine.queue_callback(state.finish_backward)
