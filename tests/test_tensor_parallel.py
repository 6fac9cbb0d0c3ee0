"""FSDP x tensor (and sequence) parallel on one DeviceMesh (issue 27): torch's real
``parallelize_module``, then ``fs.shard`` over the data-parallel dims.

World 4 = dp 2 x tp 2 (a Gloo pool; cases in ``tp_cases.py``). After 3 steps (gradient
clipping on, so the norm over both axes matters) each case's full state dict must equal a
single process trained on the global batch (no TP, no sharding): SGD with momentum 1e-6,
AdamW 1e-5, relative; the gradient norm too, every step. Torch FSDP2 runs the same recipes
in the same job as the control. One pool job runs every case (``results``), so the workers
start once. The hybrid x TP case (world 8) is slow-marked.
"""

from __future__ import annotations

import pytest

from tp_cases import errors, run_specs

TOLERANCE = {"sgd": 1e-12, "adamw": 1e-10}  # float64 (see tp_cases.DTYPES)
NORM_TOLERANCE = 1e-12
FP32_TOLERANCE = {"sgd": 1e-6, "adamw": 1e-5}  # the issue's; see test_fp32_*
CASES = {  # name -> spec (engine and optimizer added per run)
    "tp": {},
    "tp_loss_parallel": {"loss_par": True},
    "sp": {"sp": True},
    "sp_loss_parallel": {"sp": True, "loss_par": True},
    "sp_whole_mesh": {"sp": True, "whole_mesh": True},  # mesh=("dp", "tp"): tp dim removed
    "sp_shard_grad_op": {"sp": True, "strategy": "shard_grad_op"},
    "sp_no_shard": {"sp": True, "strategy": "no_shard"},
    "sp_checkpoint_reentrant": {"sp": True, "ac": "reentrant"},
    "sp_checkpoint_non_reentrant": {"sp": True, "ac": "non_reentrant"},
    "sp_checkpoint_wrapper": {"sp": True, "ac": "wrapper"},  # torch's checkpoint_wrapper
    "sp_checkpoint_fs": {"sp": True, "ac": "fs"},  # fs.checkpoint_activations
    # a tied TP embedding/head in a root big enough for the lazy root (threshold lowered)
    "sp_tied_lazy_root": {"sp": True, "tied": True, "lazy_min_bytes": 0},
    # ffn 11 over tp 2: local blocks of 6 and 5 rows, each split unevenly over dp too
    "sp_uneven_tp": {"sp": True, "ffn": 11},
    # built on the meta device: each parameter drawn whole, this rank's TP block kept
    "sp_meta_init": {"sp": True, "meta": True},
}
FSDP2_CONTROL = ("tp", "sp", "sp_loss_parallel")  # FSDP2 runs these (the rest are ours)


def _specs() -> list[dict]:
    specs = [dict(spec, name=n, engine="flatshard", optim="sgd") for n, spec in CASES.items()]
    specs += [dict(CASES[n], name=n, engine="fsdp2", optim="sgd") for n in FSDP2_CONTROL]
    for engine in ("flatshard", "fsdp2"):
        specs.append(dict(sp=True, name="sp_adamw", engine=engine, optim="adamw"))
        for optim in ("sgd", "adamw"):
            fp32 = dict(sp=True, dtype="float32", engine=engine, optim=optim)
            specs.append(dict(fp32, name=f"sp_fp32_{optim}"))
        bf16 = dict(sp=True, bf16=True, dtype="float32", engine=engine, optim="sgd")
        specs.append(dict(bf16, name="sp_bf16"))
    return specs


@pytest.fixture(scope="module")
def results(dist_pools) -> dict:
    """(name, engine) -> {"err", "norm_err", "holds"} merged over ranks (worst error; the
    ranks that hold the full state dict), or {"error": ...} from the first failing rank."""
    specs = _specs()
    outs = dist_pools(4).run(run_specs, specs, timeout=400)
    merged = {}
    for i, spec in enumerate(specs):
        per_rank = [out[i] for out in outs]
        failed = [r for r in per_rank if "error" in r]
        merged[spec["name"], spec["engine"]] = (
            failed[0]
            if failed
            else {
                "err": max(r["err"] for r in per_rank),
                "norm_err": max(r["norm_err"] for r in per_rank),
                "holders": [rank for rank, r in enumerate(per_rank) if r["holds"]],
            }
        )
    return merged


def _check_exact(r: dict, optim: str = "sgd") -> None:
    assert "error" not in r, r["error"]
    assert r["err"] <= TOLERANCE[optim], r
    assert r["norm_err"] <= NORM_TOLERANCE, r


@pytest.mark.parametrize("name", CASES)
def test_flatshard_tp_matches_single_process(results, name):
    r = results[name, "flatshard"]
    _check_exact(r)
    # the dp mesh's first rank of each tp column holds the full state dict (global ranks 0, 1)
    assert r["holders"] == [0, 1], r


@pytest.mark.harness
@pytest.mark.parametrize("name", FSDP2_CONTROL)
def test_fsdp2_tp_control_matches_single_process(results, name):
    _check_exact(results[name, "fsdp2"])


def test_adamw_matches_single_process(results):
    _check_exact(results["sp_adamw", "fsdp2"], "adamw")
    _check_exact(results["sp_adamw", "flatshard"], "adamw")


@pytest.mark.parametrize("optim", ("sgd", "adamw"))
def test_fp32_is_as_exact_as_fsdp2(results, optim):
    """In fp32 both engines differ from the single process by rounding only: within the
    issue's tolerance, or no further than FSDP2 on the same recipe (measured: SGD 8.1e-7
    for both, on a bias of magnitude 4e-4)."""
    ours, theirs = results[f"sp_fp32_{optim}", "flatshard"], results[f"sp_fp32_{optim}", "fsdp2"]
    assert "error" not in ours and "error" not in theirs, (ours, theirs)
    assert ours["err"] <= max(FP32_TOLERANCE[optim], 1.5 * theirs["err"]), (ours, theirs)
    assert ours["norm_err"] <= max(1e-6, 1.5 * theirs["norm_err"]), (ours, theirs)


def test_bf16_compute_is_as_close_as_fsdp2(results):
    """bf16 gathers with fp32 masters and fp32 reduction: not exact against fp32 training for
    either engine, and which one lands closer is luck of rounding (measured: flatshard 3.1e-2
    and 2.1e-2 at two learning rates, FSDP2 1.2e-2 and 3.6e-2). Checked: the compute really
    ran in bf16 (an error far above fp32 rounding) and the error is of FSDP2's order."""
    ours, theirs = results["sp_bf16", "flatshard"], results["sp_bf16", "fsdp2"]
    assert "error" not in ours and "error" not in theirs, (ours, theirs)
    assert 1e-4 < ours["err"] <= 4 * theirs["err"], (ours, theirs)
    assert ours["norm_err"] <= 4 * theirs["norm_err"] + 1e-4, (ours, theirs)


EXPECTED_ERRORS = {
    "overlapping": "share ranks",
    "on_both_dims": "on a 2-D mesh",
    "two_tp_meshes": "different meshes",
    "only_tp_dim": "only the tensor-parallel dim",
    "plan_after_shard": "replaced after fs.shard",
}


def test_bad_tensor_parallel_input_is_refused_clearly(dist_pools):
    for rank_errors in dist_pools(4).run(errors):
        for name, needle in EXPECTED_ERRORS.items():
            assert needle in rank_errors[name], (name, rank_errors[name])


@pytest.mark.slow
def test_hybrid_shard_times_tp_world_8(dist_pools):
    """3-D: (replicate 2, shard 2, tp 2); flatshard is given the whole named mesh."""
    spec = dict(
        name="hybrid", engine="flatshard", optim="sgd", sp=True, hybrid=True, whole_mesh=True
    )
    outs = dist_pools(8).run(run_specs, [spec], timeout=240)
    for out in outs:
        _check_exact(out[0])
