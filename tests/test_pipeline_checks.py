"""Bad input to ``fs.pipeline_step`` raises on every pp rank before a step (issue 28, goal 4.3).

World 4 = pp 2 x dp 2 (the meshes and model of ``pipeline_cases.py``), plus pp 4 over the
world group for the microbatch rules. Covered: too few microbatches for the schedule (torch's
constructors refuse them on every rank; ``microbatch_problem`` states the same rules, checked
against torch's constructors for every schedule, pp 2 and 4, 1 to 9 microbatches, and raised
by ``fs.pipeline_step`` for a count changed after construction); a stage module that
flatshard did not shard (on one pp rank only: all raise); pp ranks that built different
schedules. Each case reports how long the ranks took: nothing waits for a timeout.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

import flatshard as fs
from flatshard.parallel.pipeline_checks import microbatch_problem
from pipeline_cases import PP, SCHEDULES, TIMEOUT_S, Block, build_stages, loss_fn, meshes

# ---- run on the pool's ranks -------------------------------------------------------------------


def _schedule(cls, stages: list, n_mb: int):
    single = issubclass(cls, torch_schedules.PipelineScheduleSingle)
    return cls(stages[0] if single else stages, n_microbatches=n_mb, loss_fn=loss_fn)


def case_rules_match_torch(pp: int) -> list[str]:
    """Where ``microbatch_problem`` and torch's constructors disagree, at ``pp`` ranks."""
    group = meshes()[0].get_group() if pp == PP else dist.group.WORLD
    rank = dist.get_rank(group)
    mismatches = []
    for name, (cls, per_rank, style) in SCHEDULES.items():
        n_stages = pp * per_rank
        ids = (
            [rank, 2 * pp - 1 - rank] if style == "v" else [rank + k * pp for k in range(per_rank)]
        )
        stages = [
            PipelineStage(nn.Linear(2, 2), i, n_stages, torch.device("cpu"), group=group)
            for i in ids
        ]
        for n_mb in range(1, 10):
            try:
                _schedule(cls, stages, n_mb)
                torch_refuses = False
            except ValueError:
                torch_refuses = True
            ours = microbatch_problem(cls.__name__, n_mb, n_stages, pp)
            if torch_refuses != (ours is not None):
                mismatches.append(f"{name} pp {pp} n_mb {n_mb}: torch {torch_refuses}, ours {ours}")
    return mismatches


def _pipeline(n_mb: int, *, shard: bool = True, cls=torch_schedules.Schedule1F1B):
    pp_mesh, dp_mesh = meshes()
    pp = pp_mesh.get_local_rank()
    module = build_stages(PP)[pp]
    if shard:
        fs.shard(module, policy=fs.wrap.by_type(Block), mesh=dp_mesh, timeout_s=TIMEOUT_S)
    stage = PipelineStage(module, pp, PP, torch.device("cpu"), group=pp_mesh.get_group())
    return _schedule(cls, [stage], n_mb), pp


def _step(schedule, pp: int) -> None:
    x = torch.zeros(4, 4, dtype=torch.long)
    with fs.pipeline_step(schedule):
        schedule.step(*((x,) if pp == 0 else ()), target=x if pp == PP - 1 else None)


def case_bad_input(case: str) -> dict:
    """This rank's error (or "no error") and seconds for one bad input."""
    start = time.perf_counter()
    try:
        if case == "torch_refuses_too_few":  # torch's constructor: every rank alike
            _pipeline(1)
        elif case == "count_lowered_after_construction":
            schedule, pp = _pipeline(2)
            schedule._n_microbatches = 1  # as a torch without the constructor's check
            _step(schedule, pp)
        elif case == "last_stage_not_sharded":
            pp = meshes()[0].get_local_rank()
            _step(*_pipeline(2, shard=pp == 0))
        elif case == "different_microbatches":
            pp = meshes()[0].get_local_rank()
            _step(*_pipeline(2 + 2 * pp, cls=torch_schedules.ScheduleGPipe))
        error = "no error"
    except (ValueError, TypeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "seconds": time.perf_counter() - start}


# ---- the tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("pp", [2, 4])
def test_microbatch_rules_match_torch_constructors(dist_pools, pp):
    outs = dist_pools(4).run(case_rules_match_torch, pp, timeout=120)
    assert outs == [[]] * 4, outs


BAD_INPUT = {
    "torch_refuses_too_few": r"ValueError: Number of microbatches \(1\) must be greater than or "
    r"equal to the number of stages \(2\)",
    "count_lowered_after_construction": r"ValueError: fs.pipeline_step.*Schedule1F1B\("
    r"n_microbatches=1\) with 2 stages on 2 pp ranks: .*use n_microbatches >= 2",
    "last_stage_not_sharded": r"ValueError: fs.pipeline_step \(pp rank \d\): pp rank 1: stage 1 "
    r"\(Stage\) is not sharded by flatshard: call fs.shard\(stage_module, mesh=dp_mesh\)",
    "different_microbatches": r"ValueError: fs.pipeline_step .*the pp ranks built different "
    r"schedules \(pp rank 0: ScheduleGPipe\(2 microbatches, 2 stages\), pp rank 1: "
    r"ScheduleGPipe\(4 microbatches",
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_raises_on_every_rank_before_a_step(dist_pools, case):
    outs = dist_pools(4).run(case_bad_input, case, timeout=60)
    for rank, out in enumerate(outs):
        assert re.search(BAD_INPUT[case], out["error"]), (rank, out["error"])
        assert out["seconds"] < TIMEOUT_S, (rank, out)  # refused, not timed out


def test_microbatch_problem_names_the_schedule_the_value_and_the_fix():
    text = microbatch_problem("ScheduleInterleaved1F1B", 5, 4, 2)
    assert (
        text is not None and "n_microbatches=5" in text and "use a multiple of 2 (4 or 6)" in text
    )
    assert microbatch_problem("ScheduleDualPipeV", 3, 4, 2).endswith(
        "use n_microbatches >= 4 (or ScheduleGPipe, which takes any count)"
    )
    assert microbatch_problem("ScheduleZBVZeroBubble", 1, 4, 2) is None
