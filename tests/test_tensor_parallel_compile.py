"""Per-block ``torch.compile`` x tensor (and sequence) parallel x flatshard (issue 27).

World 4 = dp 2 x tp 2 (a Gloo pool; cases in ``tp_compile_cases.py``, model and reference
from ``tp_cases.py``). Each block is compiled with ``aot_eager`` before or after
``fs.shard``, ``fullgraph`` on and off; after 3 steps (SGD with momentum, clipping) the full
state dict must equal a single process trained on the global batch in float64 (1e-12), and
the gradient norm too, every step, with zero graph breaks. Torch FSDP2 + TP compiled the same
way runs in the same job as the control: it is *not* exact on torch 2.13 (the gradient of an
``AsyncCollectiveTensor`` block input is dropped, see [Note: async tensors at a compiled
unit's door] in compile_boundary.py; measured 1.05e-2), so its test only records that it
runs; with flatshard's settling pre-hook registered on its blocks by hand it is exact (the
diagnosis, checked). One pool job runs the default cases; the other compositions
(``tp`` after ``fs.shard``, wrapped blocks, ``fullgraph=False`` after) are slow-marked.
"""

from __future__ import annotations

import pytest

from tp_compile_cases import async_probe, run_specs

# world-4 compile jobs (~1.5 min): run in .ci/run's slow pass,
# which keeps the README command within its ~12 min budget
pytestmark = pytest.mark.slow

TOLERANCE = 1e-12  # float64, as tests/test_tensor_parallel.py
CASES = {  # name -> spec (engine added per run)
    "tp_before": {"sp": False, "how": "before"},
    "sp_before": {"sp": True, "how": "before"},
    "sp_after": {"sp": True, "how": "after"},
    "sp_before_graph_breaks_allowed": {"sp": True, "how": "before", "fullgraph": False},
    # activation checkpointing: torch's checkpoint eager around the compiled body (the route
    # that works; a checkpoint inside the compiled frame fails in torch, see below)
    "sp_checkpoint_around_compiled_body": {"sp": True, "how": "body_before", "ac": "non_reentrant"},
}
SLOW_CASES = {  # the other compositions (~30 s each on the loaded 2-core box)
    "tp_after": {"sp": False, "how": "after"},
    "sp_after_graph_breaks_allowed": {"sp": True, "how": "after", "fullgraph": False},
    "sp_wrap_before": {"sp": True, "how": "wrap_before"},
    "tp_reentrant_checkpoint_around_compiled_body": {
        "sp": False,
        "how": "body_before",
        "ac": "reentrant",
    },
}
# torch's checkpoint (any route, fs.checkpoint_activations too) *inside* a compiled block with
# DTensor parameters fails in torch's AOTAutograd (a DeviceMesh among the saved tensors), with
# or without flatshard: recorded so that the day torch fixes it shows.
CHECKPOINT_INSIDE = {
    "sp_fs_checkpoint_of_compiled_block": {"sp": True, "how": "after", "fs_ckpt": True},
    "tp_checkpoint_in_compiled_block": {"sp": False, "how": "before", "ac": "non_reentrant"},
}
TORCH_CHECKPOINT_ERROR = "expected all tensors_saved_with_vc_check to be Tensors"
# FSDP2 runs these (name -> (case, extra spec)); "settled": with flatshard's settling
# pre-hook registered on its blocks by hand, which makes it exact too (the diagnosis).
FSDP2_CONTROL = {"sp_before": ("sp_before", {}), "sp_settled": ("sp_before", {"settle": True})}
SLOW_FSDP2_CONTROL = {"tp_before": ("tp_before", {})}


def _run(pool, cases: dict, control: dict) -> dict:
    """(name, engine) -> one dict per rank, or [{"error": ...}] from the first failing rank."""
    specs = [dict(spec, name=n, engine="flatshard") for n, spec in cases.items()]
    every = CASES | SLOW_CASES
    specs += [dict(every[c], **kw, name=n, engine="fsdp2") for n, (c, kw) in control.items()]
    outs = pool.run(run_specs, specs, timeout=400)
    merged = {}
    for i, spec in enumerate(specs):
        per_rank = [out[i] for out in outs]
        failed = [r for r in per_rank if "error" in r]
        merged[spec["name"], spec["engine"]] = failed[:1] or per_rank
    return merged


@pytest.fixture(scope="module")
def results(dist_pools) -> dict:
    """The default cases, and "probe": the per-rank ``async_probe``, in one pool job."""
    pool = dist_pools(4)
    return _run(pool, CASES, FSDP2_CONTROL) | {"probe": pool.run(async_probe)}


@pytest.fixture(scope="module")
def slow_results(dist_pools) -> dict:
    return _run(dist_pools(4), SLOW_CASES | CHECKPOINT_INSIDE, SLOW_FSDP2_CONTROL)


def _check_exact(per_rank: list[dict], holders: list[bool] | None = None) -> None:
    assert "error" not in per_rank[0], per_rank[0]["error"]
    for rank, r in enumerate(per_rank):
        assert r["err"] <= TOLERANCE, (rank, r)
        assert r["norm_err"] <= TOLERANCE, (rank, r)
        assert r["breaks"] == 0, (rank, r)
        assert r["graphs"] >= 1, (rank, r)  # the blocks really were compiled
    # the dp mesh's first rank of each tp column holds the full state dict (global 0 and 1)
    holders = holders or [True, True, False, False]
    assert [bool(r["key"]) for r in per_rank] == holders, per_rank
    r = per_rank[0]
    print(f"err {max(r['err'] for r in per_rank):.1e}, {r['breaks']} breaks, {r['graphs']} graphs")


def _report_control(per_rank: list[dict], name: str) -> None:
    """FSDP2 + TP compiled the same way: runs; its error is recorded, not asserted small
    (torch drops the embedding's gradient, see the module docstring)."""
    assert "error" not in per_rank[0], per_rank[0]["error"]
    worst = max(per_rank, key=lambda r: r["err"])
    print(f"FSDP2 + TP, per-block compile, {name}: {worst['err']:.2e} ({worst['key']})")


@pytest.mark.parametrize("name", CASES)
def test_compiled_blocks_match_single_process(results, name):
    _check_exact(results[name, "flatshard"])


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_CASES)
def test_more_compositions_match_single_process(slow_results, name):
    _check_exact(slow_results[name, "flatshard"])


@pytest.mark.harness
def test_fsdp2_control_runs(results):
    _report_control(results["sp_before", "fsdp2"], "sp_before")


def test_fsdp2_with_settled_inputs_matches_single_process(results):
    """The same FSDP2 run with flatshard's settling pre-hook on its blocks is exact: its
    error is the torch problem flatshard works around, nothing of FSDP2's own."""
    _check_exact(results["sp_settled", "fsdp2"], holders=[True] * 4)


@pytest.mark.harness
@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_FSDP2_CONTROL)
def test_fsdp2_control_runs_tp(slow_results, name):
    _report_control(slow_results[name, "fsdp2"], name)


@pytest.mark.slow
@pytest.mark.parametrize("name", CHECKPOINT_INSIDE)
def test_checkpoint_inside_a_compiled_tp_block_fails_in_torch(slow_results, name):
    """The limit docs/compile.md states: a torch error (not a flatshard one), at the first
    forward. When this fails because the case ran, torch fixed it: move it to the cases."""
    r = slow_results[name, "flatshard"][0]
    assert TORCH_CHECKPOINT_ERROR in r.get("error", ""), r


@pytest.mark.harness
def test_torch_alone_drops_the_async_input_gradient(results):
    """The torch problem flatshard works around, measured without flatshard: a compiled
    function's output on an AsyncCollectiveTensor input does not require grad; settled, the
    gradient is exact. When torch fixes it (``raw`` True), the settling pre-hook
    (``register_settling``) can go: this test says so by failing."""
    for rank, probe in enumerate(results["probe"]):
        assert probe["settled"] and probe["settled_grad_ok"], (rank, probe)
        assert not probe["raw"], (
            f"rank {rank}: torch now keeps the gradient of an AsyncCollectiveTensor input to "
            "a compiled frame; [Note: async tensors at a compiled unit's door] may be obsolete"
        )
