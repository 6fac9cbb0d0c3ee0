"""A weight tied across pipeline stages (issue 28, goal 5): ``fs.tie_across_stages``.

World 4 = pp 2 x dp 2 (cases in ``pipeline_tied_cases.py``): the embedding on the first stage
and the head on the last share one weight in the single-process reference; the pipeline holds
two copies, each sharded over its stage's dp mesh. Declared with ``fs.tie_across_stages``,
every copy gets the sum of both uses' gradients after each ``fs.pipeline_step``: 3 steps equal
the single process (SGD 1e-6, AdamW 1e-5) and the copies stay bitwise equal on every rank,
for 1F1B (copies on two pp ranks), Interleaved1F1B (two stages per rank, copies on two pp
ranks) and ZBVZeroBubble / DualPipeV (V-shaped: both copies on pp rank 0), and with the dp
split at different elements of the two copies. Without the declaration the copies drift (the
check can fail). Bad declarations raise on every rank. The whole-model gradient norm counts
the tied weight once (optim/grad_norm.py skips the duplicate copies).

Tensor-parallel copies (cases in ``pipeline_tied_tp_cases.py``): world 4 = pp 2 x dp 1 x tp 2,
mesh ``("pp", "dp", "tp")``, each stage made tensor-parallel by torchtitan's plan (embedding
rowwise, head colwise: both ``Shard(0)``) in float64. Every step, on every rank, the loss and
every local gradient block (the tied copies' included) equal one process's on the global batch,
and the copies' global values are identical; after 3 steps the full state is too, for 1F1B
(copies on two pp ranks) and ZBVZeroBubble (both on pp rank 0). Copies split differently
(a ``Shard(1)`` embedding) or differing on one tp rank's block only raise on every rank.
"""

from __future__ import annotations

import re

import pytest

from pipeline_cases import TOLERANCE, case_ready
from pipeline_tied_cases import case_errors, case_tied, merge
from pipeline_tied_tp_cases import case_tied_tp, case_tp_errors
from pipeline_tied_tp_cases import merge as merge_tp

# world-4 pipeline jobs (~1 min): run in .ci/run's slow pass,
# which keeps the README command within its ~12 min budget
pytestmark = pytest.mark.slow

CASES = [  # (schedule, microbatches, optimizer)
    ("1F1B", 2, "sgd"),
    ("1F1B", 4, "adamw"),
    ("Interleaved1F1B", 2, "sgd"),
    ("Interleaved1F1B", 4, "adamw"),
    ("ZBVZeroBubble", 2, "sgd"),
    ("DualPipeV", 4, "sgd"),
]


def _spec(schedule: str, microbatches: int, optim: str, tie: bool = True) -> dict:
    return dict(schedule=schedule, microbatches=microbatches, optim=optim, tie=tie)


@pytest.fixture(scope="module")
def results(dist_pools):
    """{(schedule, microbatches, optimizer, tie): merged result}: one pool job."""
    pool = dist_pools(4)
    pool.run(case_ready)
    specs = [_spec(*c) for c in CASES] + [_spec("1F1B", 2, "sgd", tie=False)]
    specs.append({**_spec("1F1B", 2, "sgd"), "misalign": True})
    outs = pool.run(case_tied, specs, timeout=60 + 15 * len(specs))
    return {tuple(s.values()): merge(s, [o[i] for o in outs]) for i, s in enumerate(specs)}


@pytest.mark.parametrize(("schedule", "microbatches", "optim"), CASES)
def test_tied_copies_match_the_single_process(results, schedule, microbatches, optim):
    r = results[schedule, microbatches, optim, True]
    assert "error" not in r, r["error"]
    assert r["err"] <= TOLERANCE[optim], f"{r['err']:.2e} at {r['worst']}"
    # every copy on every rank (2 per dp rank: 4), identical to the bit
    assert r["copies"] == 4 and r["copy_spread"] == 0.0, r


def test_fragments_that_split_the_weight_elsewhere(results):
    """An unused 8-element parameter ahead of the head in the last stage's flat layout moves
    where the dp split falls in the head's weight: each dp rank's two fragments cover
    different element ranges, and the copies still train as one."""
    r = results["1F1B", 2, "sgd", True, True]
    assert "error" not in r, r["error"]
    assert r["ranges"]["embed.weight"] != r["ranges"]["head.weight"], r["ranges"]
    assert r["err"] <= TOLERANCE["sgd"] and r["copy_spread"] == 0.0, r


def test_without_the_declaration_the_copies_drift(results):
    """The control: each copy trained on its own half of the gradient is wrong."""
    r = results["1F1B", 2, "sgd", False]
    assert "error" not in r, r["error"]
    assert r["err"] > 1e-3 and r["copy_spread"] > 1e-3, r


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_gradient_norm_counts_the_tied_weight_once(results, schedule):
    r = results[schedule, 2, "sgd", True]
    assert "error" not in r and r["norm_err"] <= TOLERANCE["sgd"], r


def test_bad_declarations_raise_on_every_rank(dist_pools):
    outs = dist_pools(4).run(case_errors, timeout=120)
    expected = {
        "missing_name": r"ValueError: .*stage 1 \(Stage\) parameter 'head.nope' does not exist",
        "unequal_values": r"ValueError: .*hold different values; make them equal",
        "stage_out_of_range": r"ValueError: .*ties\[0\]=.* must map two or more stage indices "
        r"\(0 to 1\)",
        "not_a_list": r"TypeError: .*must be a non-empty list of mappings",
        "shape_mismatch": r"ValueError: .*differ in size or dtype.*\[16, 8\].*\[8, 16\]",
    }
    for rank, out in enumerate(outs):
        for case, pattern in expected.items():
            assert re.search(pattern, out[case]), (rank, case, out[case])


TP_CASES = [("1F1B", 2, True), ("ZBVZeroBubble", 2, True), ("1F1B", 2, False)]  # (.., tie)
TP_TOL = 1e-12  # float64


@pytest.fixture(scope="module")
def tp_results(dist_pools):
    """{(schedule, microbatches, tie): merged result} of the pp 2 x tp 2 runs: one pool job."""
    pool = dist_pools(4)
    pool.run(case_ready)
    specs = [dict(schedule=s, microbatches=n, optim="sgd", tie=t) for s, n, t in TP_CASES]
    outs = pool.run(case_tied_tp, specs, timeout=60 + 30 * len(specs))
    return {case: merge_tp(specs[i], [o[i] for o in outs]) for i, case in enumerate(TP_CASES)}


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_tensor_parallel_copies_match_the_single_process(tp_results, schedule):
    r = tp_results[schedule, 2, True]
    assert "error" not in r, r["error"]
    assert r["loss_err"] <= TP_TOL, r  # the last stage's loss, every step
    assert r["grad_err"] <= TP_TOL, f"{r['grad_err']:.2e} at {r['grad_worst']}"
    assert r["err"] <= TP_TOL, f"{r['err']:.2e} at {r['worst']}"
    # both copies on every rank of their stages (2 tp ranks each: 4), identical every step
    assert r["copies"] == 4 and r["copy_spread"] == [0.0] * 3, r


def test_tensor_parallel_copies_drift_without_the_declaration(tp_results):
    """The control: the same run, the pair undeclared, is wrong (the check can fail)."""
    r = tp_results["1F1B", 2, False]
    assert "error" not in r, r["error"]
    assert r["grad_err"] > 1e-3 and min(r["copy_spread"]) > 1e-4, r


def test_tensor_parallel_copies_split_differently_raise_on_every_rank(dist_pools):
    outs = dist_pools(4).run(case_tp_errors, timeout=120)
    expected = {
        "embedding_shard_1": r"ValueError: .*split over tensor-parallel ranks differently "
        r".*'embed.weight': '\[Shard\(dim=1\)\] over 2 tp ranks'.*"
        r"'head.weight': '\[Shard\(dim=0\)\] over 2 tp ranks'.*same placements",
        "one_tp_block_differs": r"ValueError: .*hold different values; make them equal",
    }
    for rank, out in enumerate(outs):
        for case, pattern in expected.items():
            assert re.search(pattern, out[case]), (rank, case, out[case])
