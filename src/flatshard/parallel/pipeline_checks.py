"""What ``fs.pipeline_step`` checks before a schedule's first step, on every pp rank at once.

[Note: every pp rank refuses together]
A pipeline rank that raises before ``schedule.step`` leaves its peers blocked in a
point-to-point receive until the pp group's timeout (30 minutes by default): a mistake
visible on one rank only (its stage module not sharded, another microbatch count) would hang
the others. So the first ``fs.pipeline_step`` of a schedule collects each rank's problems
(one ``all_gather_object`` over the schedule's pp group, once per schedule) and every rank
raises the same error, naming the rank that found it. Later steps only repeat the local
checks, which cost nothing.

[Note: microbatches each schedule needs]
torch 2.13's constructors refuse some counts (measured at pp 2 and pp 4, 1 to 8 microbatches);
``microbatch_problem`` states the same rules with the fix, so that a schedule whose count
changed after construction, or a torch that stops checking, still fails before a step:

    Schedule1F1B                  n >= stages
    ScheduleDualPipeV             n >= stages (2 stages per rank)
    ScheduleInterleaved1F1B,      n a multiple of its rounds, max(1, n // pp): any n < 2 pp,
    ScheduleInterleavedZeroBubble or a multiple of n // pp (a multiple of pp always works)
    ScheduleGPipe, ScheduleLoopedBFS, ScheduleZBVZeroBubble: any n >= 1 (ZBV pads its plan
    to 2 pp - 1 microbatches and drops the missing ones; exact at 1, 2 and 3, tested)
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from flatshard.core.state import STATE_ATTR

CHECKED_ATTR = "_flatshard_pipeline_checked"  # set on a schedule once its ranks agreed


def schedule_stages(schedule) -> list:
    """This rank's ``PipelineStage``s of ``schedule``, in the schedule's order."""
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    if not hasattr(schedule, "_n_microbatches") or any(s is None for s in stages):
        raise TypeError(
            f"fs.pipeline_step(schedule): got {type(schedule).__name__}; pass the "
            "torch.distributed.pipelining schedule (e.g. Schedule1F1B) whose step() you run"
        )
    return list(stages)


def microbatch_problem(schedule_name: str, n_microbatches: int, n_stages: int, pp: int):
    """Why ``n_microbatches`` is too few (or the wrong count) for ``schedule_name`` on ``n_stages``
    stages over ``pp`` ranks, with what to use; None when it is fine (see [Note: microbatches
    each schedule needs])."""
    n = n_microbatches
    where = f"{schedule_name}(n_microbatches={n}) with {n_stages} stages on {pp} pp ranks"
    if not isinstance(n, int) or n < 1:
        return f"{where}: n_microbatches must be a positive int"
    if schedule_name in ("Schedule1F1B", "ScheduleDualPipeV") and n < n_stages:
        return (
            f"{where}: it needs at least one microbatch per stage; use n_microbatches >= "
            f"{n_stages} (or ScheduleGPipe, which takes any count)"
        )
    if schedule_name in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"):
        rounds = max(1, n // pp)
        if n % rounds:
            below, above = n - n % pp, n + (-n) % pp
            return (
                f"{where}: it runs {rounds} rounds of {n // rounds} and needs n_microbatches "
                f"to be a multiple of the rounds; use a multiple of {pp} ({below} or {above}) "
                f"or fewer than {2 * pp}"
            )
    return None


def local_problems(schedule, stages: list) -> list[str]:
    """What this rank finds wrong before a step: unsharded stage modules, too few
    microbatches."""
    problems = []
    for stage in stages:
        module: nn.Module = stage.submod
        if getattr(module, STATE_ATTR, None) is None:
            problems.append(
                f"stage {stage.stage_index} ({type(module).__name__}) is not sharded by "
                "flatshard: call fs.shard(stage_module, mesh=dp_mesh) before building its "
                "PipelineStage, or step this schedule without fs.pipeline_step"
            )
    stage = stages[0]
    name = type(schedule).__name__
    problem = microbatch_problem(name, schedule._n_microbatches, stage.num_stages, stage.group_size)
    return problems + ([problem] if problem else [])


def check_schedule(schedule, stages: list) -> None:
    """``ValueError`` on every pp rank when any of them finds a problem, or when they run
    different schedules ([Note: every pp rank refuses together]); collective over the pp
    group at the schedule's first step only."""
    mine = local_problems(schedule, stages)
    if getattr(schedule, CHECKED_ATTR, False):
        if mine:  # agreed before: every rank reaches the same local verdict
            raise ValueError(f"fs.pipeline_step: {mine[0]}")
        return
    stage = stages[0]
    facts = (type(schedule).__name__, schedule._n_microbatches, stage.num_stages, mine)
    everyone: list = [None] * stage.group_size
    dist.all_gather_object(everyone, facts, group=stage.group)
    problems = [f"pp rank {r}: {p}" for r, (*_, ps) in enumerate(everyone) for p in ps]
    plans = {tuple(f[:3]) for f in everyone}
    if len(plans) > 1:
        runs = ", ".join(f"pp rank {r}: {f[0]}({f[1]} microbatches, {f[2]} stages)"
                         for r, f in enumerate(everyone))  # fmt: skip
        problems.append(
            f"the pp ranks built different schedules ({runs}); build the same schedule class "
            "with the same n_microbatches and stage count on every rank"
        )
    if problems:
        raise ValueError(f"fs.pipeline_step (pp rank {stage.group_rank}): " + "; ".join(problems))
    setattr(schedule, CHECKED_ATTR, True)
