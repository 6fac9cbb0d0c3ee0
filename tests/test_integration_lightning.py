"""Lightning's Trainer and Fabric with ``strategy="flatshard"``, against Lightning's DDP.

One launch for the module (Lightning is heavy): ``integrations/lightning_run.py`` runs every
case at world 2 under Lightning's own launcher (it starts rank 1 by re-running the script,
as for a user's ``train.py``); each test reads what both ranks measured. The tests without the
``ranks`` fixture construct a Trainer or Fabric in this process and launch nothing.
"""

from __future__ import annotations

import re
import sys

import pytest

from integration_runs import run_world2, worst

pytest.importorskip("lightning", reason="the [lightning] extra is not installed")

TOL = 1e-5  # fp32: the bar; the runs are in fact bitwise equal today


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    # the script is rank 0 and starts rank 1 itself, as a user's train.py
    return run_world2([sys.executable], "lightning_run.py", tmp_path_factory.mktemp("lightning"))


def test_trainer_losses_equal_ddp(ranks):
    for rank, res in enumerate(ranks):
        t = res["trainer"]
        assert len(t["ddp"]) == 10
        assert worst(t["ddp"], t["flat"]) <= TOL, rank
        # global-norm clipping (a norm far below the gradients') and accumulation (no_sync)
        assert worst(t["ddp_clip_acc"], t["flat_clip_acc"]) <= TOL, rank
    assert ranks[0]["trainer"]["ddp"] != ranks[1]["trainer"]["ddp"]  # each rank its own data


def test_trainer_mixed_precision(ranks):
    for res in ranks:
        t = res["trainer"]
        assert "policy" not in t["mp_bf16"]  # strategy="flatshard": the defaults
        assert "param_dtype=torch.bfloat16" in t["mp_bf16"]
        assert "reduce_dtype=torch.float32" in t["mp_bf16"]
        # bf16 parameters gathered vs DDP's autocast: the same roundings, not the same order
        assert worst(t["ddp_bf16"], t["flat_bf16"]) <= 5e-3
        assert worst(t["ddp_fp16"], t["flat_fp16"]) <= 5e-4
        assert t["scaler_fp16"] == ["GradScaler", 256.0]  # fs.GradScaler, no overflow


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_trainer_checkpoint_resumes(ranks, kind):
    for rank, res in enumerate(ranks):
        r = res[f"resume_{kind}"]
        ddp = res["resume_sharded"]["ddp"]  # DDP saved and resumed the same way
        assert len(r["flat"]) == 10
        assert worst(ddp, r["flat"]) <= TOL, rank
        assert r["is_dir"] == (kind == "sharded")
    if kind == "full":  # a plain Lightning file: the unsharded state dict, torch's optimizer keys
        full = ranks[0]["resume_full"]
        assert full["full_optimizer_keys"] == full["full_expected_keys"]


def test_fabric_equals_ddp_and_resumes(ranks):
    for rank, res in enumerate(ranks):
        f = res["fabric"]
        assert len(f["ddp"]) == 12  # 6 steps x 2 micro-batches under no_backward_sync
        assert worst(f["ddp"], f["flat"]) <= TOL, rank
        assert worst(f["flat"][6:], f["resumed"]) <= TOL, rank


def test_trainer_init_module_on_meta(ranks):
    for res in ranks:
        meta = res["trainer"]["meta"]
        assert meta["built_on_meta"] and len(meta["losses"]) == 6
        # initialised like the eager model (~ln 64 = 4.16 on random tokens), trains finitely
        assert all(3.8 < loss < 4.6 for loss in meta["losses"]), meta["losses"]


def test_fabric_init_module_on_meta(ranks):
    for res in ranks:
        meta = res["fabric"]["meta"]
        assert meta["built_on_meta"] and meta["materialised"] and meta["finite"]
        assert 3.0 < meta["loss"] < 5.0  # ln(64) = 4.16 at init


def test_each_flavour_refuses_the_other_strategy_class_naming_its_own():
    # one class cannot serve both flavours (see [Note: one class per flavour] in base.py); the
    # mistake must still say which class to use
    import lightning as L

    from flatshard.integrations.lightning import FabricFlatshardStrategy, FlatshardStrategy

    fabric_class = "flatshard.integrations.lightning.fabric.FlatshardStrategy"
    with pytest.raises(ValueError, match=re.escape(f"for lightning.Fabric use {fabric_class}")):
        L.Fabric(accelerator="cpu", devices=1, strategy=FlatshardStrategy())
    trainer_class = "flatshard.integrations.lightning.FlatshardStrategy"
    with pytest.raises(ValueError, match=re.escape(f"for lightning.Trainer use {trainer_class}")):
        L.Trainer(accelerator="cpu", devices=1, strategy=FabricFlatshardStrategy(), logger=False)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=FabricFlatshardStrategy())
    assert type(fabric.strategy) is FabricFlatshardStrategy  # the class the message names
    assert f"{type(fabric.strategy).__module__}.FlatshardStrategy" == fabric_class
