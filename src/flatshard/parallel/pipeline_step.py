"""``fs.pipeline_step``: sharded stages inside a ``torch.distributed.pipelining`` schedule.

A schedule runs every microbatch's forward and backward inside one ``schedule.step()``, with
several microbatches' graphs alive at once, and the split-backward schedules
(``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``) run each
backward as an input pass and a later weight pass. torch gives FSDP2 modules special handling
inside its stage (no gradient sync until the last microbatch, then a manual post-backward);
flatshard modules get the same from one call around the step::

    with fs.pipeline_step(schedule):
        schedule.step(x, target=y)
    optimizer.step()

The block is the explicit form: a plain ``schedule.step()`` is exact too, at the same one
reduction per unit per step, for every schedule torch 2.13 ships (torchtitan's recipe; see
[Note: a schedule stepped plainly] in ``plain_pipeline.py``). Only the block sums parameters
tied across stages or runs a schedule flatshard cannot follow (custom actions, an overridden
step), and only it checks the pp ranks agree before the first step.

Inside the block every backward keeps the units' flat gradients (as ``fs.no_sync`` does);
leaving the block reduces every unit once, over its own mesh, and assigns ``.grad``. torch
divides the gradients by the microbatches (``scale_grads=True``) at its last backward, before
flatshard assigns them: ``pipeline_step`` applies that division to what it reduces (so zero
the gradients between steps, as torch expects).

Split backward (ZeroBubble, ZBV, DualPipeV: an input pass, then a weight pass): inside the
block the fragments are leaves of the graph, so torch's weight pass reaches the units' nodes,
and the saved views it unpacks regather a released unit on demand (see [Note: fragments in the
graph] in core/hooks.py).

Checks: the first ``pipeline_step`` of a schedule agrees with every pp rank (one
``all_gather_object`` over its pp group) that each stage module is sharded and the
microbatches suit the schedule, so a mistake on one rank raises on all of them instead of
leaving the others blocked in a receive (``parallel/pipeline_checks.py``).

Tied parameters (an embedding on the first stage tied to the head on the last): declared once
with ``fs.tie_across_stages(schedule, ...)``; leaving the block then gives every copy the sum
of the copies' gradients (``parallel/pipeline_tied.py``).

Gathers: a unit is released after each microbatch's backward pass (and after its forward under
full_shard) and regathered at its next use, so a step holds one microbatch's units, at one
gather per unit per microbatch forward and backward (plus one in a weight pass that finds its
unit released).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from flatshard.core.state import ShardedState, StateMode, get_state
from flatshard.parallel.pipeline_checks import check_schedule, schedule_stages
from flatshard.parallel.pipeline_tied import TIES_ATTR
from flatshard.parallel.plain_pipeline import finish_step, install, reduces_once_per_stage
from flatshard.parallel.plain_schedule import clear_marks


@contextmanager
def pipeline_step(schedule) -> Iterator[None]:
    """One optimizer step of ``schedule`` (a ``torch.distributed.pipelining`` schedule whose
    stages wrap sharded modules): gradients are reduced once per unit, when the block ends,
    and scaled as the schedule scales them (``scale_grads``: divided by the microbatches).
    Every rank of the pipeline enters it around its ``schedule.step``. ``ValueError`` on every
    pp rank, before any step, for a stage module that is not sharded or too few microbatches
    for the schedule; copies declared with ``fs.tie_across_stages`` get their summed gradient
    when the block ends."""
    stages = schedule_stages(schedule)
    check_schedule(schedule, stages)
    states, scale = _stage_states(schedule, stages)
    for state in states:
        if state.mode is not StateMode.TRAIN:
            raise ValueError(
                f"fs.pipeline_step: a stage is in mode {state.mode.value!r} (inside no_sync, "
                "summon_full_params or another pipeline_step); leave that block first"
            )
    for state in states:
        state.mode = StateMode.PIPELINE
        clear_marks(state.root)  # a refused plain call came before (plain_schedule.py)
    # A later plain step() is exact too (plain_pipeline.py); not with ties, which it refuses.
    if getattr(schedule, TIES_ATTR, None) is None and reduces_once_per_stage(schedule):
        for stage in stages:
            install(stage)
    try:
        yield
    except BaseException:
        for state in states:  # nothing of a failed step may leak into the next one
            state.mode = StateMode.TRAIN
            for unit in state.units:
                unit.reset_grad_state()
        raise
    for state in states:
        finish_step(state, scale)  # reduce each unit once, wait, agree on usage, assign .grad
    ties = getattr(schedule, TIES_ATTR, None)
    if ties is not None:  # after every stage's .grad is assigned: sum the tied copies
        ties.sum_gradients()


def _stage_states(schedule, stages: list) -> tuple[list[ShardedState], float]:
    """The sharded states of the schedule's stages on this rank (each once, in stage order)
    and the factor its ``scale_grads`` applies."""
    states: list[ShardedState] = []
    for stage in stages:
        state = get_state(stage.submod)
        if not any(state is s for s in states):
            states.append(state)
    scale = 1.0 / schedule._n_microbatches if getattr(schedule, "scale_grads", True) else 1.0
    return states, scale
