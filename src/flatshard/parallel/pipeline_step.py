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

Gathers: by default a unit is released after each microbatch's backward pass (and after its
forward under full_shard) and regathered at its next use, so a step holds one microbatch's
units, at one gather per unit per microbatch forward and backward (plus one in a weight pass
that finds its unit released). ``keep_gathered=True`` keeps the stage gathered for the whole
step instead, as FSDP2 under torchtitan does: one gather per unit per step.

[Note: a stage kept gathered]
Inside ``pipeline_step(schedule, keep_gathered=True)`` every stage's ``ShardedState`` has
``keep_gathered`` set, and ``ShardedState.release`` (the only release the training hooks
call: after a forward pass, after a unit's last node of a backward pass, and at the end of
each backward pass in ``finish_backward``'s deferred branch) leaves the full buffers in place.
So a unit is gathered at its first use in the step and every later ``ensure_gathered`` finds
it valid: one all-gather per unit per step. What the release does per pass still happens:
fragments go back in place (``model.parameters()`` stays the fragments between calls) and a
bucket's recompute views are dropped. The weight pass of a split backward unpacks its
``SavedView``s from the same buffer (never released, so never regathered). Pooled groups hold
their borrowed buffers all at once: the pool hands a live buffer to no one else and allocates
as many as are held (``GatherPool.acquire``), then keeps only its usual few when they come
back. Leaving the block clears the flag before the one reduction per unit, whose
``reshard_all`` then releases every unit; an exception clears it and releases every unit too.
Bitwise the same results as without the flag: the same shards gathered into the same values.
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
def pipeline_step(schedule, *, keep_gathered: bool = False) -> Iterator[None]:
    """One optimizer step of ``schedule`` (a ``torch.distributed.pipelining`` schedule whose
    stages wrap sharded modules): gradients are reduced once per unit, when the block ends,
    and scaled as the schedule scales them (``scale_grads``: divided by the microbatches).
    Every rank of the pipeline enters it around its ``schedule.step``. ``ValueError`` on every
    pp rank, before any step, for a stage module that is not sharded or too few microbatches
    for the schedule; copies declared with ``fs.tie_across_stages`` get their summed gradient
    when the block ends.

    ``keep_gathered=True``: a unit gathered once stays gathered until the block ends (no
    release after a forward, nor after any microbatch's backward), then every unit is reduced
    once and released: one all-gather and one reduce-scatter per unit per step, at the memory
    of the whole stage's parameters gathered (FSDP2's ``reshard_after_forward=False`` under
    torchtitan). Default False: units are released and regathered per microbatch. Pass the
    same value on every rank (a stage's dp ranks must issue the same gathers). See [Note: a
    stage kept gathered]."""
    if not isinstance(keep_gathered, bool):  # a typo'd policy must not pass as truthy
        raise ValueError(
            f"fs.pipeline_step(schedule, keep_gathered={keep_gathered!r}): pass True (keep "
            "each stage gathered for the step) or False (release after every microbatch)"
        )
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
        state.keep_gathered = keep_gathered
        clear_marks(state.root)  # a refused plain call came before (plain_schedule.py)
    # A later plain step() is exact too (plain_pipeline.py); not with ties, which it refuses.
    if getattr(schedule, TIES_ATTR, None) is None and reduces_once_per_stage(schedule):
        for stage in stages:
            install(stage)
    try:
        yield
    except BaseException:
        _abandon(states)
        raise
    for state in states:  # before the reduction, whose reshard_all then releases every unit
        state.keep_gathered = False
    for state in states:
        finish_step(state, scale)  # reduce each unit once, wait, agree on usage, assign .grad
    ties = getattr(schedule, TIES_ATTR, None)
    if ties is not None:  # after every stage's .grad is assigned: sum the tied copies
        ties.sum_gradients()


def _abandon(states: list[ShardedState]) -> None:
    """After an exception inside the block: nothing of the failed step may leak into the next
    one (its kept gradients are dropped), and a stage kept gathered is released."""
    for state in states:
        state.mode = StateMode.TRAIN
        for unit in state.units:
            unit.reset_grad_state()
        if state.keep_gathered:
            state.keep_gathered = False
            state.reshard_all()


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
