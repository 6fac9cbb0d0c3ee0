"""torchtitan's recipe made exact: a schedule's plain ``step()`` runs its sharded stages as
``fs.pipeline_step`` does, at one reduce-scatter per unit per step.

[Note: a schedule stepped plainly]
torchtitan shards each stage module, wraps it in a ``PipelineStage`` and calls
``schedule.step()`` with nothing around it. torch makes FSDP2 exact there by recognising the
FSDP module inside its stage: no gradient sync in any backward, then one manual post-backward
in ``PipelineStage.perform_reduce_grad``, which every schedule torch 2.13 ships calls once per
stage and step, after that stage's last backward (``ScheduleGPipe``/``Schedule1F1B`` at the end
of their step; the action runtime behind the other five as a ``REDUCE_GRAD`` action placed
after the stage's last full or weight backward). flatshard answers the same two moments on
the stage itself instead of posing as an FSDP module (that would mean faking FSDP2's private
state, which ``perform_reduce_grad`` walks):

* the stage's first forward inside the first step (``plain_schedule.adopt_plain_schedule``,
  from the hooks' first-step checks, the same stack walk that finds the schedule) installs two
  wrappers on the ``PipelineStage`` instance;
* ``forward_one_chunk`` (every microbatch's forward, when the schedule has a backward) puts
  the stage's state in ``StateMode.PIPELINE`` if it is in ``TRAIN``: flat gradients are kept
  over the microbatches, and the split weight pass finds the fragments in the graph, exactly
  as inside ``fs.pipeline_step`` (the first step enters the mode at adoption already, so its
  shape-inference forward and backward run as they do there);
* ``perform_reduce_grad`` ends that mode and finishes the step as ``fs.pipeline_step``'s exit
  does (``finish_step``): the kept gradients are divided by the factor torch passes, each
  unit reduced once, ``.grad`` assigned; torch's own call then runs with factor 1, so the
  division happens once and before the reduction, as under ``fs.pipeline_step``.

Only a schedule known to call ``perform_reduce_grad`` once per local stage is adopted:
``ScheduleGPipe``/``Schedule1F1B``'s own step, or the action runtime's with a ``REDUCE_GRAD``
for each local stage and no custom action functions (one could skip either wrapper). Any other
schedule keeps the plain behaviour: a full backward reduces per microbatch (exact), a split
backward is refused (``plain_schedule.py``), and so is a schedule with ``fs.tie_across_stages``
(the ties are summed only by ``fs.pipeline_step``). A ``fs.pipeline_step`` block puts its stages
in ``PIPELINE`` mode itself, so the wrappers leave it alone (they act only on ``TRAIN``).
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any

from flatshard.core.state import STATE_ATTR, ShardedState, StateMode
from flatshard.parallel.pipeline_checks import schedule_stages

ADOPTED_ATTR = "_flatshard_plain_state"  # on a PipelineStage: the state its wrappers serve
# The states a plain step put in PIPELINE mode: perform_reduce_grad finishes only these.
_PLAIN_STEP: weakref.WeakSet[ShardedState] = weakref.WeakSet()


def reduces_once_per_stage(schedule: Any) -> bool:
    """Does ``schedule``'s step call ``perform_reduce_grad`` once per local stage, after its
    last backward (see [Note: a schedule stepped plainly])?"""
    from torch.distributed.pipelining import schedules as ts

    step = type(schedule)._step_microbatches
    if step in (ts.ScheduleGPipe._step_microbatches, ts.Schedule1F1B._step_microbatches):
        return True
    if step is not ts._PipelineScheduleRuntime._step_microbatches:
        return False
    if getattr(schedule, "_comp_type_to_function_map", None):
        return False  # a custom action function may run a stage without our wrappers
    stages = schedule_stages(schedule)
    actions = schedule.pipeline_order_with_comms.get(stages[0].group_rank, [])
    reduced = [
        a.stage_index for a in actions if a is not None and a.computation_type == ts.REDUCE_GRAD
    ]
    return sorted(reduced) == sorted(s.stage_index for s in stages)


def adopt(schedule: Any, root: Any) -> bool:
    """Install the wrappers on the stage of ``schedule`` whose module is ``root`` and, when the
    schedule has a backward, start this step's ``PIPELINE`` mode. False (nothing done) when
    the schedule is not known to reduce once per stage or no stage runs ``root``."""
    if not reduces_once_per_stage(schedule):
        return False
    stage = next((s for s in schedule_stages(schedule) if s.submod is root), None)
    if stage is None:
        return False
    install(stage)
    if schedule._has_backward:
        enter(getattr(root, STATE_ATTR))
    return True


def install(stage: Any) -> None:
    """Wrap ``stage``'s ``forward_one_chunk`` and ``perform_reduce_grad`` (once per stage)."""
    state = getattr(stage.submod, STATE_ATTR)
    if getattr(stage, ADOPTED_ATTR, None) is state:
        return
    stage.forward_one_chunk = partial(_forward_one_chunk, stage, state, stage.forward_one_chunk)
    stage.perform_reduce_grad = partial(_reduce_grad, state, stage.perform_reduce_grad)
    setattr(stage, ADOPTED_ATTR, state)


def enter(state: ShardedState) -> None:
    """Keep ``state``'s flat gradients until the stage's ``perform_reduce_grad`` (only from
    ``TRAIN``: inside ``fs.pipeline_step`` or ``no_sync`` the block decides)."""
    if state.mode is StateMode.TRAIN:
        state.mode = StateMode.PIPELINE
        _PLAIN_STEP.add(state)


def finish_step(state: ShardedState, scale: float) -> None:
    """End a pipeline step of ``state``: divide the kept flat gradients by what torch's
    ``scale_grads`` divides by, reduce each unit once, assign ``.grad``."""
    state.mode = StateMode.TRAIN
    if scale != 1.0:
        for unit in state.units:
            for flat in unit.grad.flat_grads:
                if flat is not None:
                    flat.mul_(scale)
    state.finish_backward()  # reduce each unit once, wait, agree on usage, assign .grad


def _forward_one_chunk(stage: Any, state: ShardedState, forward, *args, **kwargs):
    if stage.has_backward:
        enter(state)
    return forward(*args, **kwargs)


def _reduce_grad(state: ShardedState, reduce, grad_scale_factor: int) -> None:
    if state in _PLAIN_STEP and state.mode is StateMode.PIPELINE:
        _PLAIN_STEP.discard(state)
        finish_step(state, 1.0 / grad_scale_factor)
        grad_scale_factor = 1  # divided above, before the reduction
    return reduce(grad_scale_factor)
