"""``flatshard train --parallelism.tp 2``: 4 local CPU ranks as 2 dp x 2 tp.

Three launches for the module: A trains 4 steps at tp 2 and checkpoints, then resumes to step
6 at tp 2; B trains 6 steps at world 2, tp 1, on the same global batch (same seed, same data
order, fp32, no dropout). Tensor parallelism (with sequence parallelism) must not change the
curve: A's per-step losses equal B's, the resumed steps included. The other tests parse
configs or fail before any worker starts.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flatshard.tools.train.cli import main, parse_config
from flatshard.tools.train.config import ParallelConfig
from flatshard.tools.train.config_io import load_toml

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from fault_common import write_inputs  # the shared tiny config and a small JSONL corpus

TOL = 1e-5  # fp32: the house bar for parity
RUN = [
    "--model.dropout", "0",  # dropout masks depend on the rank layout: off for parity
    "--data.rows", "1",
    "--optim.decay_steps", "6",  # one schedule for the 4-step run and its extension
    "--checkpoint.every", "2",
    "--log.every", "1",
]  # fmt: skip


def _train(*args: str) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        and not k.startswith("SLURM_")
    }
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "flatshard.tools.cli", "train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("train_tp")
    base = [*write_inputs(root), *RUN]
    tp2 = [*base, "--nproc", "4", "--parallelism.tp", "2", "--out", str(root / "a")]
    first = _train(*tp2, "--steps", "4")
    assert first.returncode == 0, first.stderr[-3000:]
    first_losses = _losses(root / "a")
    resumed = _train(*tp2, "--steps", "6", "--resume", "--log.sample_tokens", "5")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    tp1 = _train(*base, "--nproc", "2", "--steps", "6", "--out", str(root / "b"))
    assert tp1.returncode == 0, tp1.stderr[-3000:]
    return {
        "first": first,
        "first_losses": first_losses,
        "resumed": resumed,
        "a": _losses(root / "a"),
        "b": _losses(root / "b"),
    }


@pytest.mark.slow  # three launches (tp 2, its resume, tp 1): .ci/run's slow pass
def test_tp2_learns_and_equals_tp1_on_the_same_global_batch(runs):
    assert "4 rank(s) (dp 2 x tp 2)" in runs["first"].stdout
    a4, b = runs["first_losses"], runs["b"]
    assert len(a4) == 4 and len(b) == 6
    assert all(math.isfinite(x) for x in a4) and a4[-1] < a4[0] - 0.1  # it learns
    for step, (x, y) in enumerate(zip(a4, b, strict=False), 1):
        assert abs(x - y) <= TOL * abs(y), (step, x, y)


@pytest.mark.slow
def test_tp2_resume_continues_the_same_curve(runs):
    out = runs["resumed"].stdout
    assert "resumed from" in out and "step_000004" in out
    assert "sample: 'Return the " in out  # sampling pads the context for sequence parallelism
    a, b = runs["a"], runs["b"]
    assert len(a) == 6
    assert max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)) <= TOL


def test_parallelism_is_the_parallel_section():
    cfg, _ = parse_config(["--parallelism.tp", "2", "--parallelism.loss_parallel=true"])
    assert cfg.parallel.tp == 2 and cfg.parallel.loss_parallel
    same, _ = parse_config(["--parallel.tp", "2", "--parallel.loss_parallel", "true"])
    assert same == cfg
    assert parse_config([])[0].parallel.tp == 1


def test_parallelism_table_in_a_config_file(tmp_path):
    (tmp_path / "c.toml").write_text(
        '[parallel]\nstrategy = "shard_grad_op"\n[parallelism]\ntp = 2\n'
    )
    cfg = load_toml(tmp_path / "c.toml")
    assert (cfg.parallel.tp, cfg.parallel.strategy) == (2, "shard_grad_op")


def test_tp_must_be_positive():
    with pytest.raises(ValueError, match=r"parallel.tp=0 must be >= 1"):
        ParallelConfig(tp=0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--nproc", "4", "--parallelism.tp", "3"],
            "parallel.tp=3 does not divide the world size 4",
        ),
        (
            ["--nproc", "2", "--parallelism.tp", "2", "--data.seq_len", "63"],
            "data.seq_len=63 is not divisible by parallel.tp=2",
        ),
    ],
)
def test_unusable_tp_is_refused_before_any_worker_starts(
    args, message, tmp_path, monkeypatch, capsys
):
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    assert main([*args, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
