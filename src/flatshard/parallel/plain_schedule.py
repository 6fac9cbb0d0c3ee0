"""A split-backward pipeline schedule called plainly: refused on every rank, before any update.

[Note: a schedule called without fs.pipeline_step]
torchtitan's recipe shards each stage and calls ``schedule.step()`` plainly. With flatshard
that is exact for the schedules whose backward is one pass per microbatch (GPipe, 1F1B,
Interleaved1F1B, LoopedBFS), at one reduce-scatter per unit per microbatch. The split-backward
schedules (``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``)
run each backward as an input pass and a later weight pass; called plainly, a unit reduces
after the input pass, before the weight pass adds its parameters' gradients, and the model
trains away from one process with no error. Only ``with fs.pipeline_step(schedule):`` makes
them exact (the reduction waits for the end of the step).

Raising where it is seen (a stage's first forward inside the schedule) would leave the other
pp ranks blocked in a receive. So each unit's first forward of a pass, in the first step only
(no per-step cost; a middle stage's root may hold no unit), looks up the call stack for a
schedule's ``step``; if the schedule splits its
backward and no ``fs.pipeline_step`` is active, every fragment of the stage is marked. The step
finishes on every rank (its communication is complete), and the optimizer guard
(``optim/guard.py``) raises at the first ``optimizer.step()`` on every rank holding a marked
fragment: every pp rank holds a stage, so every rank raises, and no wrong update is applied.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

PLAIN_SCHEDULE_ATTR = "_flatshard_plain_split_schedule"  # on a fragment: the schedule's name
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


def mark_if_plain_split_schedule(root: torch.nn.Module) -> None:
    """Mark ``root``'s fragments when a split-backward schedule runs it without
    ``fs.pipeline_step`` (see the Note); called by a stage's first forward outside that mode."""
    first = next(root.parameters(), None)
    if first is None or hasattr(first, PLAIN_SCHEDULE_ATTR):
        return  # nothing to mark, or marked by an earlier unit of this stage
    schedule = schedule_in_stack()
    if schedule is None or not splits_backward(schedule):
        return
    name = type(schedule).__name__
    for param in root.parameters():
        setattr(param, PLAIN_SCHEDULE_ATTR, name)


def clear_marks(root: torch.nn.Module) -> None:
    """Forget a plain call's marks (``fs.pipeline_step`` now runs the stage)."""
    for param in root.parameters():
        if hasattr(param, PLAIN_SCHEDULE_ATTR):
            delattr(param, PLAIN_SCHEDULE_ATTR)


def refuse_plain_split_schedule(params: list[torch.Tensor]) -> None:
    """``ValueError`` (the optimizer guard's first step) if any of ``params`` was trained by a
    split-backward schedule called without ``fs.pipeline_step``."""
    marked = (getattr(p, PLAIN_SCHEDULE_ATTR) for p in params if hasattr(p, PLAIN_SCHEDULE_ATTR))
    name = next(marked, None)
    if name is None:
        return
    raise ValueError(
        f"{name} ran sharded stages without fs.pipeline_step: it splits each backward into an "
        "input pass and a weight pass, and a unit reduced after the input pass misses the weight "
        "pass's gradients, so this step's gradients are wrong (nothing was updated). Call it as "
        "`with fs.pipeline_step(schedule): schedule.step(...)`, or use a schedule with a full "
        "backward (Schedule1F1B, ScheduleInterleaved1F1B, ScheduleGPipe, ScheduleLoopedBFS)"
    )
