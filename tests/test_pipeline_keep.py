"""``fs.pipeline_step(schedule, keep_gathered=True)``: each stage gathered once per step.

World 4 = pp 2 x dp 2, the model and reference of ``pipeline_cases.py`` (cases in
``pipeline_keep_cases.py``), 3 SGD-with-momentum steps at 4 microbatches. Each variant (a
strategy, bf16, buckets, CPU offload, activation checkpointing, no gather pool) runs
with and without ``keep_gathered``: both must end where the single process ends (fp32
variants; 1e-6 relative, as test_pipeline.py), on bit-identical fragments (every variant,
bf16 included: the same shards gathered into the same values), with one reduce-scatter per
reduction per step either way and, kept gathered, exactly one all-gather per gathered group
per step (every unit gathered once), no unit released before the block ends and no buffer
shared by two gathered groups (the gather pool allocates one per unit), every unit released
after it. Measured counts: docs/parallelism.md.
"""

from __future__ import annotations

import pytest
import torch

import flatshard as fs
from pipeline_cases import TOLERANCE
from pipeline_keep_cases import VARIANTS, case_failing, case_keep, case_tied_keep

MICROBATCHES = 4
# schedule -> stages per rank
SCHEDULES = {
    "GPipe": 1,
    "1F1B": 1,
    "Interleaved1F1B": 2,
    "InterleavedZeroBubble": 2,
    "ZBVZeroBubble": 2,
}
# Every variant under one full-backward and one split-backward schedule (whose weight pass
# unpacks saved views); the others in full_shard and bf16. Activation checkpointing under a
# split backward fails with or without keep_gathered (its weight pass recomputes on the
# fragments: a limit of fs.pipeline_step, not of this option).
EVERY_VARIANT = {
    "1F1B": VARIANTS,
    "InterleavedZeroBubble": [v for v in VARIANTS if v != "checkpoint"],
}
CASES = [(s, v) for s in SCHEDULES for v in EVERY_VARIANT.get(s, ("full_shard", "bf16"))]
PARITY_VARIANTS = [v for v in VARIANTS if v != "bf16"]  # bf16 is compared with itself only


def _spec(schedule: str, variant: str, keep: bool) -> dict:
    return dict(
        schedule=schedule,
        microbatches=MICROBATCHES,
        per_rank=SCHEDULES[schedule],
        variant=variant,
        keep=keep,
        optim="sgd",
    )


@pytest.fixture(scope="module")
def results(dist_pools):
    """``results(schedule)`` -> {(variant, keep): per-rank results}: one pool job per schedule."""
    cache: dict = {}

    def get(schedule: str) -> dict:
        if schedule not in cache:
            keys = [(v, k) for s, v in CASES if s == schedule for k in (False, True)]
            specs = [_spec(schedule, v, k) for v, k in keys]
            outs = dist_pools(4).run(case_keep, specs, timeout=60 + 10 * len(specs))
            cache[schedule] = {key: [o[i] for o in outs] for i, key in enumerate(keys)}
        return cache[schedule]

    return get


def _ok(per_rank: list[dict]) -> list[dict]:
    errors = [r["error"] for r in per_rank if "error" in r]
    assert not errors, errors[0]
    return per_rank


@pytest.mark.parametrize("schedule, variant", CASES)
def test_kept_gathered_is_exact_and_gathers_each_unit_once(results, schedule, variant):
    by_keep = {k: _ok(results(schedule)[variant, k]) for k in (False, True)}
    kept = by_keep[True]
    if variant in PARITY_VARIANTS:
        assert max(r["err"] for r in kept) <= TOLERANCE["sgd"], max(r["worst"] for r in kept)
        assert sorted(i for r in kept for i in r["held"]) == list(range(2 * SCHEDULES[schedule]))
    for rank, (before, after) in enumerate(zip(by_keep[False], kept, strict=True)):
        pairs = zip(before["fragments"], after["fragments"], strict=True)
        assert all(torch.equal(a, b) for a, b in pairs), f"rank {rank}: not bit-identical"
        # one reduce-scatter per reduction either way, and each gathered group gathered once
        assert after["rs"] == before["rs"] == [1.0] * len(after["rs"]) or variant == "no_shard"
        assert after["ag"] == after["groups"] == after["ag_first"], (rank, after)
        # inside every block: nothing released yet, no buffer held by two groups
        assert all(seen == {"released": 0, "shared": 0} for seen in after["seen"]), after["seen"]
        assert after["released_after"], f"rank {rank}: a unit still gathered after the block"
    assert any(r["groups"] != [0] * len(r["groups"]) for r in kept) or variant == "no_shard"


@pytest.mark.parametrize("schedule", ["1F1B", "InterleavedZeroBubble"])
def test_default_still_regathers_per_microbatch(results, schedule):
    """keep_gathered=False (the default) is today's behaviour: more gathers than units."""
    for r in _ok(results(schedule)["full_shard", False]):
        assert all(a > g for a, g in zip(r["ag"], r["groups"], strict=True)), r
        assert all(seen["released"] > 0 for seen in r["seen"]), r["seen"]


def test_an_exception_in_the_block_releases_every_unit(dist_pools):
    specs = [_spec(s, "full_shard", True) for s in ("1F1B", "InterleavedZeroBubble")]
    outs = dist_pools(4).run(case_failing, specs, timeout=120)
    for rank, per_spec in enumerate(outs):
        for r in per_spec:
            assert "error" not in r, r["error"]
            assert r["released_after"] and not r["grads_kept"], (rank, r)


def test_tied_stages_kept_gathered_match_the_single_process(dist_pools):
    from pipeline_tied_cases import merge

    specs = [
        dict(schedule=s, microbatches=MICROBATCHES, optim="sgd")
        for s in ("1F1B", "InterleavedZeroBubble")
    ]
    outs = dist_pools(4).run(case_tied_keep, specs, timeout=120)
    for i, spec in enumerate(specs):
        r = merge(spec, [o[i] for o in outs])
        assert "error" not in r, r["error"]
        assert r["err"] <= TOLERANCE["sgd"] and r["copy_spread"] == 0.0, r


def test_keep_gathered_takes_a_bool():
    with (
        pytest.raises(ValueError, match=r"keep_gathered='yes'\): pass True"),
        fs.pipeline_step(object(), keep_gathered="yes"),  # type: ignore[arg-type]
    ):
        pass
