"""Pipeline x data x tensor parallel at world 8 (issue 28, goal 4): pp 2 x dp 2 x tp 2.

Each stage of the transformer in ``pipeline_3d_cases.py`` is made tensor-parallel with torch's
``parallelize_module`` on ``mesh["tp"]`` (colwise/rowwise, SequenceParallel norms with
``sp``), sharded by ``fs.shard`` over ``mesh["dp"]`` (or the named ``mesh["dp", "tp"]``), and
run by a ``torch.distributed.pipelining`` schedule over ``mesh["pp"]`` inside
``fs.pipeline_step``, clipped by ``fs.clip_grad_norm_(stages, 0.5, across=mesh["pp"])``. After
3 steps (float64) every stage's full state equals one process trained on the global batch,
and the clipped norm equals its norm every step (about 2e-15), for 1F1B, Interleaved1F1B
and the split-backward schedules (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV: their
weight pass unpacks saved DTensor weights, which features/saved_views.py regathers). World 8:
slow-marked (``FLATSHARD_SLOW=1``), one pool job for every case.
"""

from __future__ import annotations

import pytest

from pipeline_3d_cases import TOLERANCE, case_3d, merge

pytestmark = pytest.mark.slow

CASES = {  # id -> spec
    "1F1B-sp": dict(schedule="1F1B", microbatches=2, sp=True, optim="sgd"),
    "1F1B-no-sp": dict(schedule="1F1B", microbatches=4, sp=False, optim="sgd"),
    "1F1B-sp-dp-tp-mesh": dict(
        schedule="1F1B", microbatches=2, sp=True, optim="sgd", whole_mesh=True
    ),
    "1F1B-sp-adamw": dict(schedule="1F1B", microbatches=2, sp=True, optim="adamw"),
    "Interleaved1F1B-sp": dict(schedule="Interleaved1F1B", microbatches=2, sp=True, optim="sgd"),
    "Interleaved1F1B-sp-4mb": dict(
        schedule="Interleaved1F1B", microbatches=4, sp=True, optim="sgd"
    ),
    "InterleavedZeroBubble-sp": dict(
        schedule="InterleavedZeroBubble", microbatches=2, sp=True, optim="sgd"
    ),
    "ZBVZeroBubble-sp": dict(schedule="ZBVZeroBubble", microbatches=2, sp=True, optim="sgd"),
    "DualPipeV-sp-4mb": dict(schedule="DualPipeV", microbatches=4, sp=True, optim="sgd"),
}


@pytest.fixture(scope="module")
def results(dist_pools):
    specs = list(CASES.values())
    outs = dist_pools(8).run(case_3d, specs, timeout=120 + 60 * len(specs))
    return {name: merge(s, [o[i] for o in outs]) for i, (name, s) in enumerate(CASES.items())}


@pytest.mark.parametrize("case", list(CASES))
def test_3d_matches_single_process(results, case):
    r = results[case]
    assert "error" not in r, r["error"]
    n_stages = 2 if case.startswith("1F1B") else 4
    assert r["held"] == list(range(n_stages)), r
    # the full state lives on the first dp rank of each tp column of each pp rank
    assert r["holders"] == [0, 1, 4, 5], r
    assert r["err"] <= TOLERANCE[r["optim"]], f"{r['err']:.2e} at {r['worst']}"
    assert r["norm_err"] <= 1e-12, r
