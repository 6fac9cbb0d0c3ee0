"""``FlatshardTrainer`` against the stock ``transformers.Trainer`` (DDP through Accelerate).

One torchrun launch for the module (``integrations/hf_run.py``, world 2, CPU/Gloo); each test
reads what both ranks measured.
"""

from __future__ import annotations

import pytest

from integration_runs import run_world2, torchrun, worst

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("trl")

TOL = 1e-5


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_world2(torchrun(), "hf_run.py", tmp_path_factory.mktemp("hf"))


def test_losses_and_grad_norms_equal_ddp(ranks):
    for res in ranks:
        assert len(res["ddp"]) == 20
        assert worst(res["ddp"], res["flat"]) <= TOL
        # the logged norm is the global one (before clipping at 0.1: every step clips)
        assert worst(res["ddp_grad_norms"], res["grad_norms"]) <= TOL * 10
        assert min(res["grad_norms"]) > 0.1


def test_resume_from_checkpoint_reproduces_the_losses(ranks):
    for res in ranks:
        assert len(res["resumed"]) == 20
        assert worst(res["flat"][10:], res["resumed"][10:]) <= TOL
    files = ranks[0]["checkpoint_files"]
    assert {"flatshard", "model.safetensors", "config.json", "scheduler.pt"} <= set(files)


def test_save_model_loads_with_from_pretrained(ranks):
    assert ranks[0]["from_pretrained_err"] == 0.0


def test_gradient_checkpointing_and_bf16(ranks):
    for res in ranks:
        assert worst(res["flat"][:4], res["gc"]) <= 1e-6
        assert worst(res["ddp_bf16"], res["flat_bf16"]) <= 5e-3


def test_trl_sft_trainer_with_the_mixin_equals_ddp(ranks):
    for res in ranks:
        assert len(res["sft_ddp"]) == 6
        assert worst(res["sft_ddp"], res["sft_flat"]) <= TOL
