"""``flatshard train --model.experts 4 --parallelism.ep 2``: the MoE GPT, experts split over ep.

One module fixture launches, at world 4 on the same data (fp32, no dropout): A with ep 2 (each
rank holds 2 of the 4 experts per layer, tokens travel by all-to-all, each ``Experts`` unit is
sharded over the 2 ranks holding it), then A resumed from its step-2 checkpoint, and B with
ep 1 (every rank holds every expert). Expert parallelism must not change the curve: A's
per-step losses, gradient norms, validation losses and final sample equal B's. Checkpoints of
models with per-unit (expert) meshes are being enabled in ``fs.save``; while it refuses them
the resume test is skipped with that reason. The other tests fail before any worker starts.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from flatshard.tools.train.cli import main, parse_config
from flatshard.tools.train.resolve import gpt_config, moe_config

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from fault_common import metrics, run_train, write_inputs  # the shared tiny config, a small corpus

TOL = 1e-5  # fp32: the house bar for parity
REFUSED = "cannot be checkpointed yet"  # the trainer's words while fs.save refuses expert meshes
RUN = [
    "--model.dropout", "0", "--model.experts", "4", "--model.top_k", "2",
    "--optim.decay_steps", "4", "--checkpoint.every", "2",
    "--log.every", "1", "--log.val_every", "2", "--log.sample_tokens", "5",
    "--nproc", "4",
]  # fmt: skip


def _train(*args: str):
    return run_train(list(args))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("train_moe")
    base = [*write_inputs(root), *RUN]
    ep2 = [*base, "--parallelism.ep", "2", "--out", str(root / "a")]
    first = _train(*ep2, "--steps", "2")
    resumed, refused = None, REFUSED in first.stderr
    if refused:  # fs.save does not take per-unit meshes yet: train without checkpoints
        first = _train(*ep2, "--steps", "4", "--checkpoint.enabled", "false")
    else:
        assert first.returncode == 0, first.stderr[-3000:]
        resumed = _train(*ep2, "--steps", "4", "--resume")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert first.returncode == 0, first.stderr[-3000:]
    ep1 = _train(*base, "--steps", "4", "--out", str(root / "b"))
    assert ep1.returncode == 0, ep1.stderr[-3000:]
    last = resumed if resumed is not None else first
    return {"a": metrics(root / "a"), "b": metrics(root / "b"), "a_out": last.stdout,
            "b_out": ep1.stdout, "refused": refused, "resumed": resumed}  # fmt: skip


@pytest.mark.slow  # two or three world-4 launches (~2-3 min on the shared 2-core box)
def test_ep2_equals_ep1_step_for_step(runs):
    a, b = runs["a"], runs["b"]
    assert len(a) == len(b) == 4 and all(math.isfinite(r["loss"]) for r in a)
    assert a[-1]["loss"] < a[0]["loss"]  # it learns
    for got, want in zip(a, b, strict=True):
        for key in ("loss", "grad_norm", "val_loss"):
            if want.get(key) is not None:
                assert abs(got[key] - want[key]) <= TOL * abs(want[key]), (key, got, want)
    assert "MoE GPT (4 experts, top-2, ep 2)" in runs["a_out"]
    sample = [line for line in runs["a_out"].splitlines() if line.startswith("sample: ")]
    assert sample and sample == [
        line for line in runs["b_out"].splitlines() if line.startswith("sample: ")
    ]


@pytest.mark.slow
def test_ep2_resume_continues_the_same_curve(runs):
    if runs["refused"]:
        pytest.skip(
            "fs.save refuses models with per-unit (expert) meshes (NotImplementedError) in "
            "this tree: the lead is enabling it; the test runs again once it does"
        )
    assert "resumed from" in runs["resumed"].stdout
    a, b = runs["a"], runs["b"]
    assert (
        max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(a, b, strict=True)) <= TOL
    )


def test_moe_options_build_the_moe_config():
    cfg, _ = parse_config(["--model.experts", "8", "--model.top_k", "1", "--parallelism.ep", "4"])
    shape = moe_config(cfg)
    assert (shape.n_experts, shape.top_k, cfg.parallel.ep) == (8, 1, 4)
    assert shape.d_model == gpt_config(cfg).d_model and shape.n_layers == gpt_config(cfg).n_layers
    with pytest.raises(ValueError, match=r"model\.top_k=5 exceeds model\.experts=4"):
        parse_config(["--model.experts", "4", "--model.top_k", "5"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "4", "--parallelism.ep", "2"], "parallel.ep=2 needs a Mixture-of-Experts"),
        (["--nproc", "4", "--model.experts", "3", "--parallelism.ep", "2"],
         "parallel.ep=2 must divide the world size 4 and model.experts=3"),
        (["--nproc", "4", "--model.experts", "4", "--parallelism.tp", "2"],
         "parallel.tp=2 cannot be combined with model.experts"),
    ],
)  # fmt: skip
def test_unusable_expert_layouts_are_refused_before_any_worker_starts(
    args, message, tmp_path, monkeypatch, capsys
):
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    assert main([*args, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
