"""Forward/backward hooks: the training-state machine of every unit.

Flow per unit and iteration:
  pre-forward   gather (or wait for the prefetched gather), prefetch the next unit, install
                full-shape views; with grad enabled the views come out of one ``UnitViews``
                autograd node per unit call
  post-forward  reinstall fragments, reshard (full_shard), hook the outputs' gradients
  pre-backward  (first gradient reaching an output) gather again, prefetch the next unit
  post-backward ``UnitViews.backward`` runs once all of this call's parameter gradients exist:
                flatten them, and when the unit's last forward call is accounted for,
                reduce-scatter and reshard
  end of backward  (one queued autograd callback) reduce units whose node never ran, wait,
                agree across ranks on which parameters were used, assign ``.grad``

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

from . import saved_views
from .precision import MixedPrecision, cast_floating
from .state import ShardedState
from .unit import Unit


class UnitViews(torch.autograd.Function):
    """Hands out full-shape views of a unit's gathered buffers; its backward is post-backward."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, state: ShardedState, unit: Unit):  # type: ignore[override]
        del anchor  # only there so that autograd calls backward
        ctx.state, ctx.unit = state, unit
        ctx.set_materialize_grads(False)
        return tuple(v for gi in unit.trainable_groups for v in unit.groups[gi].full_views())

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        on_unit_grads(ctx.state, ctx.unit, grads)
        return None, None, None


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass (a forward now = recomputation)."""
    return torch._C._current_graph_task_id() != -1


def make_views(state: ShardedState, unit: Unit) -> list[list[torch.Tensor]]:
    """Full-shape views per group; autograd-connected when a backward may follow."""
    views = [g.full_views() for g in unit.groups]
    trainable = unit.trainable_groups
    if trainable and torch.is_grad_enabled():
        outs = iter(UnitViews.apply(unit.anchor, state, unit))
        for gi in trainable:
            views[gi] = [next(outs) for _ in unit.groups[gi].specs]
        unit.grad.pending_nodes += 1
    return views


def register_hooks(state: ShardedState) -> list[Any]:
    handles = []
    for unit in state.units:
        module = unit.module
        handles.append(
            module.register_forward_pre_hook(
                partial(_pre_forward, state, unit), with_kwargs=True, prepend=True
            )
        )
        handles.append(
            module.register_forward_hook(
                partial(_post_forward, state, unit), with_kwargs=True, always_call=True
            )
        )
    return handles


def register_precision_casts(model: nn.Module, mp: MixedPrecision) -> list[Any]:
    """Cast the root's floating inputs to ``param_dtype`` and outputs to ``output_dtype``."""
    handles = []
    if mp.cast_forward_inputs and mp.param_dtype is not None:

        def cast_inputs(module, args, kwargs):
            return cast_floating(args, mp.param_dtype), cast_floating(kwargs, mp.param_dtype)

        handles.append(model.register_forward_pre_hook(cast_inputs, with_kwargs=True))
    if mp.output_dtype is not None:
        handles.append(
            model.register_forward_hook(lambda m, a, out: cast_floating(out, mp.output_dtype))
        )
    return handles


def _pre_forward(state: ShardedState, unit: Unit, module, args, kwargs):
    if state.summoned:  # full parameters are already installed; no collective may run
        return None
    if state.recompute_in_backward and in_backward():  # activation-checkpoint recomputation
        state.ensure_gathered(unit)
        unit.install_views(recompute_views(unit))
        return None
    state.forward_order.observe(unit)
    state.ensure_gathered(unit)
    state.prefetch(state.forward_order.after(unit, state.prefetch_policy.forward))
    saved_views.enter(state.pool, unit)
    unit.install_views(make_views(state, unit))
    unit.forward_depth += 1
    return None


def _post_forward(state: ShardedState, unit: Unit, module, args, kwargs, output):
    if state.summoned or (state.recompute_in_backward and in_backward()):
        return None
    saved_views.leave(unit)
    unit.forward_depth = max(0, unit.forward_depth - 1)
    if unit.forward_depth == 0:  # not inside an outer call of the same unit (register_method)
        unit.install_fragments()
        # The last unit of the forward is the first of the backward: keep it (one regather
        # less per step). Only with grad: a no-grad forward has no backward to wait for.
        last = state.forward_order.is_last(unit)
        keep = torch.is_grad_enabled() and last
        if unit.reshard_after_forward and not keep:
            unit.reshard(state.timeout)
        if last and state.pool is not None:
            state.pool.trim()
    if torch.is_grad_enabled() and unit.grad.pending_nodes > 0:
        _hook_output_grads(state, unit, output)
    return None


def _hook_output_grads(state: ShardedState, unit: Unit, output) -> None:
    tensors, _ = tree_flatten(output)
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(partial(_pre_backward, state, unit))


def _pre_backward(state: ShardedState, unit: Unit, grad: torch.Tensor) -> None:
    _queue_final_callback(state)
    state.backward_order.observe(unit)
    state.ensure_gathered(unit)
    if state.prefetch_policy.backward == "pre":
        state.prefetch(state.backward_order.after(unit))
    if state.recompute_in_backward:
        unit.install_views(recompute_views(unit))


def recompute_views(unit: Unit) -> list[list[torch.Tensor]]:
    """Full views for a forward recomputed in backward: leaves that require grad exactly where
    the parameters do, so recomputation saves the same tensors as the first forward did."""
    return [
        [v.detach().requires_grad_(g.requires_grad) for v in g.full_views()] for g in unit.groups
    ]


def on_unit_grads(state: ShardedState, unit: Unit, grads: tuple) -> None:
    """Post-backward of one unit call: accumulate its gradients; reduce after the last call."""
    _queue_final_callback(state)
    offset = 0
    for gi in unit.trainable_groups:
        group = unit.groups[gi]
        mine = grads[offset : offset + len(group.specs)]
        offset += len(group.specs)
        if all(g is None for g in mine):
            continue
        previous = unit.grad.flat_grads[gi]
        if (
            previous is None
            and _reduce_right_away(state, unit)
            and group.reduces_pieces(state.topology)
        ):
            unit.grad.flat_grads[gi] = tuple(mine)  # reduced without a flat copy
        else:
            flat = group.flat_grad_from(mine)
            unit.grad.flat_grads[gi] = flat if previous is None else previous.add_(flat)
        unit.grad.used[gi] |= torch.tensor([g is not None for g in mine])
    unit.grad.pending_nodes = max(0, unit.grad.pending_nodes - 1)
    if unit.grad.pending_nodes == 0:
        if not state.defer_reduce:
            state.launch_reduce(unit)
        if state.recompute_in_backward:
            unit.install_fragments()
        unit.reshard(state.timeout)
        if state.prefetch_policy.backward == "post":
            state.prefetch(state.backward_order.after(unit))


def _reduce_right_away(state: ShardedState, unit: Unit) -> bool:
    """This call's gradients are the unit's last of this backward and get reduced next."""
    return unit.grad.pending_nodes == 1 and not state.defer_reduce


def _queue_final_callback(state: ShardedState) -> None:
    if not state.final_callback_queued:
        state.final_callback_queued = True
        Variable._execution_engine.queue_callback(state.finish_backward)
