"""One checkpoint across pipeline stages (issue 28 goal 3), against torch's real
``torch.distributed.pipelining`` schedules and DCP: pp 2 x dp 2 stages (one and two per rank)
save one checkpoint with ``fs.save(..., across=pp)``; a plain model over dp 4 loads it exactly
and takes the same next step; its checkpoint loads back into fresh stages the same way (see
tests/pp_checkpoint_cases.py). float64 and AdamW, so the optimizer state's round trip shows in
the next step."""

from __future__ import annotations

import pytest

from pp_checkpoint_cases import run_3d_route, run_routes

# one stage per rank; two (two optimizers) per rank; a tied embedding/head (a copy on the
# last stage, fs.tie_across_stages) <-> a tied model: the head's other name reads its own keys
SCHEDULES = ("1F1B", "Interleaved1F1B", "1F1B-tied", "ZBVZeroBubble-tied")
LOADED_TOLERANCE = 0.0  # the load puts back the saved values, bit for bit
STEP_TOLERANCE = 1e-12  # the next step: the same math in another order (float64)


@pytest.fixture(scope="module")
def routes(dist_pools) -> list[dict]:
    return dist_pools(4).run(run_routes, list(SCHEDULES), timeout=240)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("what", ["pp_to_dp4_loaded", "dp4_to_pp_loaded"])
def test_a_load_puts_back_the_saved_state(routes, schedule, what):
    for rank, out in enumerate(routes):
        err, key = out[schedule][what]
        assert err <= LOADED_TOLERANCE, f"rank {rank} {schedule} {what}: {key} off by {err}"


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("what", ["pp_to_dp4_next_step", "dp4_to_pp_next_step"])
def test_the_next_step_agrees_with_or_without_a_pipeline(routes, schedule, what):
    for rank, out in enumerate(routes):
        err, key = out[schedule][what]
        assert err <= STEP_TOLERANCE, f"rank {rank} {schedule} {what}: {key} off by {err}"


@pytest.mark.slow  # world 8
def test_one_checkpoint_across_pp_dp_and_tp(dist_pools):
    """pp 2 x dp 2 x tp 2 -> dp 4 x tp 2 (no pipeline) -> back: the parts and the TP blocks'
    origins in one checkpoint."""
    for rank, out in enumerate(dist_pools(8).run(run_3d_route, timeout=400)):
        for what, (err, key) in out.items():
            tolerance = LOADED_TOLERANCE if what.endswith("loaded") else STEP_TOLERANCE
            assert err <= tolerance, f"rank {rank} {what}: {key} off by {err}"
