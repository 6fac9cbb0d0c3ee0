"""Expert-parallel checkpoints and full state dicts at another EP degree (issue 28 goal 3):
a MoE model with its experts on their own mesh saves with ``fs.save`` (each expert a chunk of
the global stacked tensor, placed by ``Experts.flatshard_placement``) and loads at ep 4, ep 1
(no expert parallelism) and ep 2, and back, against a one-process model
(tests/ep_checkpoint_cases.py); its full state dict holds the global expert stacks."""

from __future__ import annotations

import pytest

from ep_checkpoint_cases import run_routes

# a world-4 job of 8 routes (~1 min): run in .ci/run's slow pass,
# which keeps the README command within its ~12 min budget
pytestmark = pytest.mark.slow

TOLERANCE = 1e-12  # float64: the ep 2 training itself is exact to ~1e-16

ROUTES = [
    "ep2_trained",
    "ep2_to_ep4_loaded",
    "ep2_to_ep4_next_step",
    "ep2_to_ep1_loaded",
    "ep2_to_ep1_next_step",
    "ep2_to_ep2_loaded",
    "ep2_to_ep2_next_step",
    "ep4_to_ep2_loaded",
    "full_state_dict",  # global expert stacks on rank 0, {} elsewhere
    "load_full_state_dict_ep4",
    "safetensors_ep4",  # weights alone, each rank reading its experts' slices
    "export_ep2",  # fs.export_safetensors writes the global expert stacks
]


@pytest.fixture(scope="module")
def routes(dist_pools) -> list[dict]:
    return dist_pools(4).run(run_routes, timeout=240)


@pytest.mark.parametrize("route", ROUTES)
def test_an_expert_parallel_checkpoint_loads_at_another_degree(routes, route):
    for rank, out in enumerate(routes):
        assert out[route] <= TOLERANCE, f"rank {rank} {route}: off by {out[route]}"


def test_fragment_info_places_each_rank_experts(routes):
    for rank, out in enumerate(routes):
        assert out["fragment_info"] == [], (rank, out["fragment_info"])
