"""Checkpoints across (dp, tp) layouts and engines (issue 27, goal 3); cases in
``tp_checkpoint_cases.py``, one world-4 pool job.

A flatshard dp 2 x tp 2 checkpoint (model + SGD momentum) loads exactly into dp 2 x tp 2,
into dp 1 x tp 4 (another plan), into plain 1-D flatshard at dp 4, and into torch FSDP2 + TP
(``dcp.load`` + ``set_state_dict``); a torch FSDP2 + TP checkpoint (torchtitan's layout)
loads into flatshard + TP; a safetensors file of the full weights loads into flatshard + TP,
each rank reading its blocks' slices. Each loaded model holds the saved values and its next
step lands where the saving model's next step does (float64: only rounding may differ,
1e-12).
"""

from __future__ import annotations

import pytest

from tp_checkpoint_cases import run_all

TOLERANCE = 1e-12
ROUTES = (
    "flatshard_dp1_tp4",
    "flatshard_tp",
    "flatshard_dp4",
    "fsdp2_tp",
    "fsdp2_to_flatshard_tp",
    "safetensors_tp",
)


@pytest.fixture(scope="module")
def results(dist_pools, tmp_path_factory) -> list[dict]:
    return dist_pools(4).run(run_all, str(tmp_path_factory.mktemp("tp_ckpt")), timeout=240)


@pytest.mark.parametrize("route", ROUTES)
def test_checkpoint_route_is_exact(results, route):
    for rank, per_rank in enumerate(results):
        loaded, next_step = per_rank[route]
        assert loaded <= TOLERANCE and next_step <= TOLERANCE, (rank, route, per_rank[route])


def test_fragment_info_reports_global_shapes_and_origins(results):
    for rank, per_rank in enumerate(results):
        info = per_rank["fragment_info"]
        assert info["problems"] == [], (rank, info["problems"])
        assert info["shifted"] == (rank % 2 == 1), rank  # tp rank 1's blocks sit further on
