"""Experts sharded over their own mesh, dense layers over the model's (issue 28, goal 2).

World 4 = ("efsdp", "ep") = (2, 2); cases in ``ep_cases.py`` (one pool job). A policy returns
``mesh["efsdp"]`` for ``Experts`` modules: each expert-parallel rank's experts are sharded over
the ranks that hold the same experts, and their gradients are averaged over the model's whole
data-parallel world (not the expert mesh: torchtitan's PR #1551 trap). float64, so only
rounding may differ from one process holding every expert (1e-12).
"""

from __future__ import annotations

import pytest

from ep_cases import run_all

TOLERANCE = 1e-12


@pytest.fixture(scope="module")
def results(dist_pools) -> list[dict]:
    return dist_pools(4).run(run_all, timeout=240)


@pytest.mark.parametrize("case", ["4_experts", "2_experts"])
def test_experts_on_their_own_mesh_match_one_process(results, case):
    for rank, per_rank in enumerate(results):
        r = per_rank[case]
        assert r["params"] <= TOLERANCE and r["norm"] <= TOLERANCE, (rank, case, r)


def test_bad_unit_meshes_are_refused_clearly(results):
    for per_rank in results:
        errors = per_rank["errors"]
        assert "not all ranks of the model's mesh" in errors["foreign_ranks"], errors
        assert "give it a method flatshard_placement()" in errors["full_state_dict"], errors
