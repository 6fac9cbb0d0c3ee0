"""Whole-parameter optimizers, full optimizer state dicts and exports on tensor-parallel
models (issue 27): each equals one process on the unsharded model.

World 4 (a Gloo pool, one job for every case; cases in ``tp_optim_cases.py``): dp 2 x tp 2,
float64, errors relative to each tensor's largest element, on every rank's fragments and on
the full state dict where a rank holds it.

Tolerances (float64 rounding is ~1e-16; an engine error is of the order of the update):
* Muon 1e-10: the Newton–Schulz iteration runs in bf16 (as torch's), on the same bf16 matrix
  bit for bit as long as the float64 momentum rounds to the same bf16 values, which a 1e-16
  difference in the gradient (another summation order) flips with a chance of ~1e-13 per
  element; otherwise only float64 rounding remains. A misplaced block, a missing tp gather or
  a local (not global) shape in the learning-rate rule is of order 1e-3 and more.
* Adafactor, AdamW, the exported file and state 1e-10 (float64 rounding only; measured
  <= 2e-15 everywhere, Muon included).
"""

from __future__ import annotations

import pytest

from tp_optim_cases import run_all

# world-4 optimizer jobs (~1 min): run in .ci/run's slow pass,
# which keeps the README command within its ~12 min budget
pytestmark = pytest.mark.slow

TOL = 1e-10
TRAIN = {  # name -> spec: Muon / Adafactor on dp 2 x tp 2
    "muon_tp": dict(optim="muon", sp=False),
    "muon_sp": dict(optim="muon", sp=True),
    # ffn 11 over tp 2: blocks of 6 and 5 rows (colwise) or columns (rowwise), split
    # unevenly over dp as well
    "muon_sp_uneven": dict(optim="muon", sp=True, ffn=11),
    "adafactor_tp": dict(optim="adafactor", sp=False),
    "adafactor_sp": dict(optim="adafactor", sp=True),
    "adafactor_sp_uneven": dict(optim="adafactor", sp=True, ffn=11),
    # controls: the same recipes without TP (plain dp 4)
    "muon_dp": dict(optim="muon", sp=False, layout="dp"),
    "adafactor_dp": dict(optim="adafactor", sp=False, layout="dp"),
}
RELOAD = {  # name -> (save layout, load layout, optimizer)
    f"{optim}_{save}_to_{load}": dict(save=save, load=load, optim=optim)
    for optim in ("adamw", "adafactor")
    for save, load in (("tp", "tp"), ("tp", "dp"), ("dp", "tp"))
}


# Slow-marked (a second pool job, run only when a slow test is selected): what the default
# cases already cover another way (SP norms are SGD's under Muon; the controls run no TP).
SLOW = {
    "muon_sp", "adafactor_sp", "muon_dp", "adafactor_dp",
    "adafactor_tp_to_tp", "adafactor_dp_to_tp",
}  # fmt: skip


def _specs(slow: bool) -> list[dict]:
    specs = [dict(spec, kind="train", name=n) for n, spec in TRAIN.items()]
    specs += [dict(spec, kind="reload", name=n) for n, spec in RELOAD.items()]
    if slow:
        return [spec for spec in specs if spec["name"] in SLOW]
    specs = [spec for spec in specs if spec["name"] not in SLOW]
    return [*specs, dict(kind="export", name="export"), dict(kind="pretrained", name="hf")]


def _run(dist_pools, tmp_path_factory, slow: bool) -> dict:
    """name -> every rank's result (a list of 4 dicts), one pool job for all the cases."""
    specs = _specs(slow)
    root = str(tmp_path_factory.mktemp("tp_optim"))
    outs = dist_pools(4).run(run_all, specs, root, timeout=400)
    return {spec["name"]: [out[i] for out in outs] for i, spec in enumerate(specs)}


@pytest.fixture(scope="module")
def results(dist_pools, tmp_path_factory) -> dict:
    return _run(dist_pools, tmp_path_factory, slow=False)


@pytest.fixture(scope="module")
def slow_results(dist_pools, tmp_path_factory) -> dict:
    return _run(dist_pools, tmp_path_factory, slow=True)


def _cases(names) -> list:
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in names]


def _result(request, name: str) -> list[dict]:
    return request.getfixturevalue("slow_results" if name in SLOW else "results")[name]


@pytest.mark.slow
def test_whole_param_optimizers_hybrid_shard_times_tp_world_8(dist_pools, tmp_path):
    """(replicate 2, shard 2, tp 2): Muon's owners and Adafactor's sums per shard group, the
    replicas doing the same work."""
    specs = [
        dict(kind="train", name=f"{optim}_hybrid", optim=optim, sp=True, layout="hybrid")
        for optim in ("muon", "adafactor")
    ]
    outs = dist_pools(8).run(run_all, specs, str(tmp_path), timeout=400)
    for per_rank in zip(*outs, strict=True):
        _no_errors(per_rank)
        assert max(r["err"] for r in per_rank) <= TOL, per_rank
        # the first rank of each dp mesh: global ranks 0 and 1 (one per tp column)
        assert [rank for rank, r in enumerate(per_rank) if r["holds"]] == [0, 1], per_rank


def _no_errors(per_rank: list[dict]) -> None:
    failed = [r["error"] for r in per_rank if "error" in r]
    assert not failed, failed[0]


@pytest.mark.parametrize("name", _cases(TRAIN))
def test_whole_param_optimizer_matches_single_process(request, name):
    per_rank = _result(request, name)
    _no_errors(per_rank)
    assert max(r["err"] for r in per_rank) <= TOL, per_rank
    # the first dp rank of each tp column holds the full state dict (global ranks 0, 1)
    holders = [0, 1] if TRAIN[name].get("layout", "tp") == "tp" else [0]
    assert [rank for rank, r in enumerate(per_rank) if r["holds"]] == holders, per_rank


@pytest.mark.parametrize("name", _cases(RELOAD))
def test_full_optimizer_state_moves_between_layouts(request, name):
    """The saved state equals the reference optimizer's (global tensors, on the holders),
    and after loading it into the other layout the next step equals the reference's."""
    per_rank = _result(request, name)
    _no_errors(per_rank)
    assert max(r["saved_err"] for r in per_rank) <= TOL, per_rank
    assert max(r["err"] for r in per_rank) <= TOL, per_rank
    holders = [rank for rank, r in enumerate(per_rank) if r["holds"]]
    assert holders == ([0, 1] if RELOAD[name]["load"] == "tp" else [0]), per_rank


def test_export_safetensors_writes_global_tensors(results):
    per_rank = results["export"]
    _no_errors(per_rank)
    assert [r["written"] for r in per_rank] == [True, False, False, False], per_rank
    assert per_rank[0]["keys_match"], per_rank
    assert per_rank[0]["file_err"] <= TOL, per_rank
    # read back into a fresh TP model (load_full_state_dict_from_file): every rank's blocks
    assert max(r["read_back_err"] for r in per_rank) <= TOL, per_rank


def test_save_pretrained_of_tp_model_loads_with_from_pretrained(results):
    per_rank = results["hf"]
    _no_errors(per_rank)
    assert [r["written"] for r in per_rank] == [True, False, False, False], per_rank
    assert per_rank[0]["keys_match"], per_rank
    assert per_rank[0]["err"] == 0.0, per_rank  # a copy: no arithmetic at all
