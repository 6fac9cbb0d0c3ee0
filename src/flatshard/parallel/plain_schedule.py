"""A schedule's plain ``step()`` on sharded stages: adopted (exact) or refused on every rank.

[Note: a schedule called without fs.pipeline_step]
torchtitan's recipe shards each stage and calls ``schedule.step()`` plainly. Each unit's first
forward of a pass, in the first step only (no per-step cost; a middle stage's root may hold no
unit, so every unit asks), looks up the call stack for a schedule's ``step``. If it finds one:

* a schedule known to call ``perform_reduce_grad`` once per stage (every schedule torch 2.13
  ships, run by torch's own step) is adopted: the stage runs as under ``fs.pipeline_step``,
  exact at one reduce-scatter per unit per step (see [Note: a schedule stepped plainly] in
  ``plain_pipeline.py``);
* otherwise a full-backward schedule keeps the plain behaviour (exact, one reduce-scatter per
  unit per microbatch), while a split-backward one (an input pass, then a weight pass: a unit
  would reduce after the input pass and miss the weight pass's gradients) is refused, and so
  is any schedule with ``fs.tie_across_stages`` (only ``fs.pipeline_step`` sums the ties).

Raising where it is seen (a stage's forward) would leave the other pp ranks blocked in a
receive. So a refused stage's fragments are marked with the reason; the step finishes on every
rank (its communication is complete), and the optimizer guard (``optim/guard.py``) raises at
the first ``optimizer.step()`` on every rank holding a marked fragment: every pp rank holds a
stage, so every rank raises, and no wrong update is applied.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from flatshard.parallel.pipeline_tied import TIES_ATTR
from flatshard.parallel.plain_pipeline import adopt

PLAIN_SCHEDULE_ATTR = "_flatshard_plain_schedule_refused"  # on a fragment: why it was refused
SPLIT_ACTIONS = ("BACKWARD_INPUT", "BACKWARD_WEIGHT")
MAX_FRAMES = 64  # a schedule's step is a few frames above a stage's forward


def schedule_in_stack() -> Any | None:
    """The ``torch.distributed.pipelining`` schedule whose ``step`` is running on this thread's
    stack, if any (only frames of that package are inspected)."""
    frame = sys._getframe(1)
    for _ in range(MAX_FRAMES):
        if frame is None:
            return None
        if "pipelining" in frame.f_code.co_filename:
            owner = frame.f_locals.get("self")
            if owner is not None and _is_schedule(owner):
                return owner
        frame = frame.f_back
    return None


def _is_schedule(obj: Any) -> bool:
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    return isinstance(obj, _PipelineSchedule)


def splits_backward(schedule: Any) -> bool:
    """Does ``schedule`` run a backward as separate input and weight passes?"""
    order = getattr(schedule, "pipeline_order", None) or {}
    for actions in order.values():
        for action in actions:
            kind = getattr(action, "computation_type", None)
            if kind is not None and kind.name in SPLIT_ACTIONS:
                return True
    return False


def adopt_plain_schedule(root: torch.nn.Module) -> None:
    """A stage's first forward outside ``fs.pipeline_step`` (see the Note): adopt the
    schedule running ``root`` plainly, or mark ``root``'s fragments when it is refused."""
    first = next(root.parameters(), None)
    if first is None or hasattr(first, PLAIN_SCHEDULE_ATTR):
        return  # nothing to mark, or marked by an earlier unit of this stage
    schedule = schedule_in_stack()
    if schedule is None:
        return
    reason = refusal(schedule)
    if reason is None and adopt(schedule, root):
        return
    if reason is None and splits_backward(schedule):
        reason = (
            f"{type(schedule).__name__} splits each backward into an input pass and a weight "
            "pass, and flatshard cannot tell when this schedule's step ends (it overrides the "
            "step, registers custom action functions or has no REDUCE_GRAD per stage), so a "
            "unit reduced after the input pass and missed the weight pass's gradients"
        )
    if reason is not None:
        for param in root.parameters():
            setattr(param, PLAIN_SCHEDULE_ATTR, reason)


def refusal(schedule: Any) -> str | None:
    """Why a plain ``step()`` of ``schedule`` cannot be exact whatever the schedule, if so."""
    if getattr(schedule, TIES_ATTR, None) is not None:
        return (
            f"{type(schedule).__name__} has parameters tied across stages "
            "(fs.tie_across_stages), which only fs.pipeline_step sums"
        )
    return None


def clear_marks(root: torch.nn.Module) -> None:
    """Forget a plain call's marks (``fs.pipeline_step`` now runs the stage)."""
    for param in root.parameters():
        if hasattr(param, PLAIN_SCHEDULE_ATTR):
            delattr(param, PLAIN_SCHEDULE_ATTR)


def refuse_plain_schedule(params: list[torch.Tensor]) -> None:
    """``ValueError`` (the optimizer guard's first step) if any of ``params`` was trained by a
    schedule called without ``fs.pipeline_step`` that could not be exact (see the Note)."""
    marked = (getattr(p, PLAIN_SCHEDULE_ATTR) for p in params if hasattr(p, PLAIN_SCHEDULE_ATTR))
    reason = next(marked, None)
    if reason is None:
        return
    raise ValueError(
        f"a pipeline schedule ran sharded stages without fs.pipeline_step: {reason}; so this "
        "step's gradients are wrong (nothing was updated). Call it as "
        "`with fs.pipeline_step(schedule): schedule.step(...)`"
    )
