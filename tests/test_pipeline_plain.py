"""torchtitan's pipeline recipe, unchanged (issue 37, goal 1): sharded stages in
``PipelineStage``s, ``schedule.step()`` called plainly, exact with one reduce-scatter per unit
per step for every schedule torch ships, as under ``fs.pipeline_step``.

World 4 = pp 2 x dp 2 (a Gloo pool); cases in ``pipeline_plain_cases.py``. Every rank's
fragments after 2 SGD-with-momentum steps are compared with a single process trained on the
global batch (1e-6 relative), and every step's reduce-scatters per reduction are counted (the
first step too: it runs torch's shape-inference forward and backward). Fast: a full-backward
and two split-backward schedules plainly, and the fallback for a schedule flatshard cannot
follow; ``FLATSHARD_SLOW=1``: every schedule x microbatches x stages per rank, plain and
explicit.
"""

from __future__ import annotations

import pytest

from pipeline_cases import SCHEDULES, case_ready
from pipeline_plain_cases import case_plain, case_tied_plain

TOLERANCE = 1e-6
JOB_TIMEOUT_S = 30  # per job, plus 15 s per spec: only a crashed worker waits this long


def _cases() -> list[tuple[str, int, int]]:
    """(schedule, microbatches, stages per rank): as tests/test_pipeline.py runs them."""
    out = []
    for name, (_, per_rank, style) in SCHEDULES.items():
        for k in (per_rank,) if per_rank == 1 or style == "v" else (per_rank, 1):
            out += [(name, m, k) for m in (2, 4) if (name, m, k) != ("DualPipeV", 2, 2)]
    return out


def _run(pool, specs: list[dict]) -> list[list[dict]]:
    """Per spec, every rank's result (an ``error`` entry where that rank raised)."""
    pool.run(case_ready)  # the workers' start-up is not a job's time
    outs = pool.run(case_plain, specs, timeout=JOB_TIMEOUT_S + 15 * len(specs))
    return [[o[i] for o in outs] for i in range(len(specs))]


def _check_exact(
    spec: dict, per_rank: list[dict], per_step: float = 1, first: int = 0, last: int = -1
) -> None:
    """Every rank exact, with ``per_step`` reduce-scatters per reduction in every step from
    ``first`` to ``last``."""
    for rank, r in enumerate(per_rank):
        assert "error" not in r, (spec, rank, r["error"])
        assert r["err"] <= TOLERANCE, (spec, rank, r["err"], r["worst"])
        checked = r["rs"][first : None if last == -1 else last + 1]
        for step, counts in enumerate(checked, first):  # per stage of this rank
            assert counts == [per_step] * len(counts), (spec, rank, step, counts)


def _spec(schedule: str, microbatches: int = 4, per_rank: int | None = None, **extra) -> dict:
    default = SCHEDULES[schedule][1]
    return dict(schedule=schedule, microbatches=microbatches, per_rank=per_rank or default, **extra)


FAST = [_spec("1F1B", mode="plain"), _spec("ZBVZeroBubble", mode="plain"),
        _spec("InterleavedZeroBubble", 2, 1, mode="plain")]  # fmt: skip


def test_plain_recipe_is_exact_with_one_reduce_scatter_per_unit_per_step(dist_pools):
    for spec, per_rank in zip(FAST, _run(dist_pools(4), FAST), strict=True):
        _check_exact(spec, per_rank)


def test_plain_recipe_with_an_eval_step_between(dist_pools):
    """``schedule.eval`` (forward only) between two plain training steps: still exact. torch
    reruns its shape inference for the backward in the next step, outside the microbatches'
    forwards, so a stage its inference backward reaches (the last) reduces once more in that
    step; every other step is one reduce-scatter per unit. (torch 2.13's ``eval`` of a V-shaped
    schedule fails without flatshard too: not tested here.)"""
    specs = [_spec("1F1B", mode="plain", eval_between=True)]
    (per_rank,) = _run(dist_pools(4), specs)
    _check_exact(specs[0], per_rank, per_step=1, last=0)  # the first step: one
    assert all(r["rs"][1] in ([1.0], [2.0]) for r in per_rank), per_rank


def test_plain_recipe_refuses_what_flatshard_cannot_follow_on_every_rank(dist_pools):
    """A custom ``REDUCE_GRAD`` action function hides the step's end from flatshard: a
    split-backward schedule would train wrong, so every rank raises at its first
    ``optimizer.step()`` (after the step's communication completed: no rank is left
    waiting), naming fs.pipeline_step; a full-backward one stays exact, reducing per
    microbatch."""
    specs = [
        _spec("InterleavedZeroBubble", mode="plain", custom_reduce=True),
        _spec("Interleaved1F1B", mode="plain", custom_reduce=True),
    ]
    refused, fallback = _run(dist_pools(4), specs)
    for rank, r in enumerate(refused):
        error = r.get("error", "")
        assert error.startswith("ValueError") and "fs.pipeline_step" in error, (rank, r)
    # one reduction per microbatch from the second step on (the first also reduces after
    # torch's shape-inference backward)
    _check_exact(specs[1], fallback, per_step=specs[1]["microbatches"], first=1)


def test_plain_recipe_refuses_tied_parameters_on_every_rank(dist_pools):
    """Parameters tied across stages (``fs.tie_across_stages``) are summed only by
    ``fs.pipeline_step``: a plain step is refused on every rank at ``optimizer.step()``."""
    specs = [_spec("1F1B")]
    outs = dist_pools(4).run(case_tied_plain, specs, timeout=JOB_TIMEOUT_S + 15)
    for rank, (r,) in enumerate(outs):
        error = r.get("error", "")
        assert error.startswith("ValueError") and "tie_across_stages" in error, (rank, r)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["plain", "explicit"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_schedule_plain_and_explicit(dist_pools, schedule, mode):
    specs = [_spec(s, m, k, mode=mode) for s, m, k in _cases() if s == schedule]
    for spec, per_rank in zip(specs, _run(dist_pools(4), specs), strict=True):
        _check_exact(spec, per_rank)
