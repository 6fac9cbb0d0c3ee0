"""Forward/backward hooks: the training-state machine of every unit.

Flow per unit and iteration:
  pre-forward   one function per kind of call (``Entry``: a plain unit's forward, a bucket
                member's, the root's tail, a recomputation in backward, a reentrant one, none
                while summoned): gather (or wait for the prefetched gather), prefetch the next
                unit, install full-shape views; with grad enabled the views come out of one
                ``UnitViews`` autograd node per unit call (``unit_views.py``)
  post-forward  one for every unit (see [Note: one post-forward]): hook the outputs'
                gradients, and when the unit's forward pass is over reinstall fragments and
                reshard (full_shard)
  pre-backward  (first gradient reaching an output) gather again, prefetch the next unit,
                install recompute views (see [Note: recomputation] in ``recompute.py``)
  post-backward ``UnitViews.backward`` runs once all of this call's parameter gradients exist:
                flatten them, and when the unit's last forward call is accounted for,
                reduce-scatter and reshard (``unit_views.py``)
  end of backward  (one queued autograd callback) reduce units whose node never ran, wait,
                agree across ranks on which parameters were used, assign ``.grad``
A bucket of coalesced units is one unit whose hooks sit on several modules: its members'
forward calls open through ``members.py`` (one pass, one node; see [Note: coalesced units]).

[Note: one post-forward]
Plain units and buckets end a forward call in the same ``_post_forward``. A bucket differs
only in when its forward *pass* is over (``members.end_call``: every member ran and no member
call is in progress); a plain unit's pass is its outermost call. When the pass is over the
fragments go back in place and the unit is released (if it reshards after forward), except:
* after a reentrant recomputation's call: its nested backward follows right away;
* the last unit of the forward (in the recorded order) when the model has no root tail and
  grad is enabled: it is the first unit of the backward, so keeping it saves one regather.
  With the root's tail split off (the default for a model with a final norm or an untied head)
  the tail's backward comes first and its pre-backward prefetches the last unit behind the
  head's backward, so the last unit is released before the loss, where memory peaks
  (docs/performance.md: "the last block released before the loss when there is a tail").
Until session 13 a bucket had a post-forward of its own (``members.post_forward``) that kept
the last bucket even with a tail; there is one rule now, tested by
``tests/test_one_post_forward.py`` on both layouts.
"""

from __future__ import annotations

import enum
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from flatshard.core.state import ShardedState, StateMode
from flatshard.core.unit import ParamState, Unit
from flatshard.core.unit_views import UnitViews as UnitViews  # re-exported: the node's home
from flatshard.core.unit_views import call_done, make_views, queue_final_callback, recompute_views
from flatshard.features import lazy_root, members, recompute, saved_views
from flatshard.features.compile_boundary import register_plain_keys, register_settling, untraced
from flatshard.features.recompute import Call, CallKind
from flatshard.parallel.plain_schedule import adopt_plain_schedule
from flatshard.precision import MixedPrecision, cast_floating


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


class Entry(enum.Enum):
    """What a unit's pre-forward does for the call starting now (one function each, see
    ``_ENTRIES``)."""

    SUMMONED = "summoned"  # inside summon_full_params: full parameters installed, no collective
    FORWARD = "forward"  # a plain unit's forward: gather, prefetch, one counted node per call
    MEMBER = "member"  # a bucket's member in forward: one pass, one node (members.py)
    TAIL = "tail"  # the root's tail in forward: placeholders until a parameter is used
    RECOMPUTE = "recompute"  # in backward, refilling the first forward's saved tensors: views
    REENTRANT = "reentrant"  # in backward, the graph a nested backward will use: counted node


def entry_for(state: ShardedState, unit: Unit) -> Entry:
    """Which :class:`Entry` a forward call of ``unit`` starting now is."""
    if state.mode is StateMode.SUMMONED:
        return Entry.SUMMONED
    kind = recompute.classify_call(unit)
    if kind is CallKind.RECOMPUTE:
        return Entry.RECOMPUTE
    if kind is CallKind.REENTRANT:
        return Entry.REENTRANT
    return Entry.TAIL if unit.is_tail else Entry.MEMBER if unit.merged else Entry.FORWARD


def _pre_forward(state: ShardedState, unit: Unit, module, args, kwargs):
    entry = entry_for(state, unit)
    # Until the first backward ends (the step order is frozen then): not a per-step cost.
    if state.forward_order.frozen is None and entry in (Entry.FORWARD, Entry.MEMBER, Entry.TAIL):
        _first_step_checks(state, unit, module, entry)
    _ENTRIES[entry](state, unit, module)
    return None


def _first_step_checks(state: ShardedState, unit: Unit, module, entry: Entry) -> None:
    """Parameters still in place; which member ran when (checks the buckets' order). A
    merged unit's pass in progress has its other members' views in place."""
    if unit.forward_depth == 0 and not unit.forward_pass.started:
        _check_fragments_in_place(unit)
        if state.mode is not StateMode.PIPELINE:  # a stage's root may hold no unit: every unit
            adopt_plain_schedule(state.root)  # see parallel/plain_schedule.py
    if entry is not Entry.TAIL:
        state.observe_member(unit, unit.member_position(module))


def _enter_summoned(state: ShardedState, unit: Unit, module) -> None:
    return None


def _enter_forward(state: ShardedState, unit: Unit, module) -> None:
    state.gather_for_step(unit)
    state.forward_order.observe(unit)
    state.prefetch(state.ahead(state.forward_order, unit, state.prefetch_policy.forward))
    _open_call(state, unit, CallKind.FORWARD)


def _enter_member(state: ShardedState, unit: Unit, module) -> None:
    members.pre_forward(state, unit, unit.member_position(module), _OPS)


def _enter_recompute(state: ShardedState, unit: Unit, module) -> None:
    """Gradients flow through the first forward's graph: views only, no node."""
    _recomputing(unit, module)
    state.gather_for_step(unit)
    unit.install_views(recompute_views(state, unit))
    unit.calls.append(Call(CallKind.RECOMPUTE))


def _enter_reentrant(state: ShardedState, unit: Unit, module) -> None:
    _recomputing(unit, module)
    state.gather_for_step(unit)
    _open_call(state, unit, CallKind.REENTRANT)


def _recomputing(unit: Unit, module) -> None:
    """A bucket's member recomputed in backward: its ``no_grad`` forward is made up for."""
    if unit.merged:
        unit.nograd_members.discard(unit.member_position(module))


def _open_call(state: ShardedState, unit: Unit, kind: CallKind) -> None:
    """Install this call's views, from one counted node when grad is enabled."""
    _enter_saved_views(state, unit)
    views, node = make_views(state, unit)
    unit.install_views(views)
    unit.forward_depth += 1
    unit.calls.append(Call(kind, node))


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


def _enter_tail(state: ShardedState, unit: Unit, module) -> None:
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
    """See [Note: one post-forward]."""
    if state.mode is StateMode.SUMMONED:
        return None
    call = unit.calls.pop() if unit.calls else Call(CallKind.FORWARD)
    unused_tail = unit.is_tail and call.kind is CallKind.FORWARD and call.views is None
    if unused_tail and unit.state is not ParamState.SHARDED:  # (sharded: its gather failed)
        _tail_views(state, unit, call)  # unused in this forward: its node must exist all the same
    if call.kind is CallKind.RECOMPUTE:  # views stay until this unit's post-backward
        return None
    saved_views.leave(unit)
    unit.forward_depth = max(0, unit.forward_depth - 1)
    in_pass = unit.merged and call.kind is CallKind.FORWARD
    if torch.is_grad_enabled() and unit.grad.pending_nodes > 0:
        _hook_output_grads(state, unit, output)
    if call.node is not None:
        _settle_node(state, unit, call, in_pass, (args, kwargs), output)
    if in_pass and not members.end_call(unit, module):
        return None  # the bucket's forward pass goes on
    if unit.forward_depth == 0:  # not inside an outer call of the same unit (register_method)
        _release_after_forward(state, unit, call)
    return None


def _settle_node(state: ShardedState, unit: Unit, call: Call, in_pass: bool, inputs, output):
    """Will this call's node run? If nothing of the output depends on the views (a reentrant
    checkpoint inside the unit ran them under ``no_grad``) it never will: the gradients come
    from the recomputation, and the unit's inputs tell when they are complete. A bucket's
    pass shares one node: such a member call gets a count of its own, and the pass's node
    keeps its count only if some member's output reached it (``members.end_call``)."""
    if recompute.output_reaches(unit, output, call.node):
        if in_pass:
            unit.forward_pass.reached = True
        return
    if in_pass:
        unit.grad.pending_nodes += 1
    _post_backward_on_inputs(state, unit, inputs)


def _release_after_forward(state: ShardedState, unit: Unit, call: Call) -> None:
    """The forward pass of ``unit`` is over: fragments back, and release it unless backward
    needs it next (see [Note: one post-forward])."""
    unit.install_fragments()
    last = state.forward_order.is_last(unit)
    keep_last = last and not state.tail_first and torch.is_grad_enabled()
    if unit.reshard_after_forward and not (call.kind is CallKind.REENTRANT or keep_last):
        state.release(unit)  # not inside fs.pipeline_step(keep_gathered=True)
    if last and state.pool is not None and call.kind is CallKind.FORWARD:
        state.pool.trim()


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
    tensors = recompute.post_backward_on_inputs(inputs, partial(call_done, state, unit))
    for t in tensors:
        hooked = getattr(t, PRE_BACKWARD, None) or []
        for handle, _, _ in hooked:
            handle.remove()
        setattr(t, PRE_BACKWARD, [])
        for _, owner, other in hooked:
            _hook_output_grads(owner, other, t)


def _pre_backward(state: ShardedState, unit: Unit, grad: torch.Tensor) -> None:
    queue_final_callback(state)
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


# What a bucket's member calls share with a plain unit call (see members.py).
_OPS = members.HookOps(make_views, _enter_saved_views)
_ENTRIES = {
    Entry.SUMMONED: _enter_summoned,
    Entry.FORWARD: _enter_forward,
    Entry.MEMBER: _enter_member,
    Entry.TAIL: _enter_tail,
    Entry.RECOMPUTE: _enter_recompute,
    Entry.REENTRANT: _enter_reentrant,
}
