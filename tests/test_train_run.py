"""``flatshard train`` end to end on 2 local CPU ranks: outputs, checkpoints, exact resume.

The CI check of issue 7: ``--steps 40 --nproc 2 --out DIR`` then ``--steps 50 --resume`` must
continue the very same curve as an uninterrupted 50-step run (fp32: equal losses). A tiny model
and short rows keep each run to a few seconds of training; most of the time is process start-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flatshard.train.cli import parse_config
from flatshard.train.config_io import load_toml
from flatshard.train.resolve import resolve

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from fault_common import TINY_TOML  # the one tiny-run config, shared with bench/

# This test's differences from the shared tiny config, as CLI overrides.
OVERRIDES = [
    "--optim.decay_steps", "50",  # fixed: the 40-step run and its extension share one schedule
    "--checkpoint.every", "20",
    "--log.val_every", "20",
    "--log.val_batches", "2",
    "--log.plot_every", "1000",
    "--log.sample_tokens", "8",
]  # fmt: skip


def _train(*args: str) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK") and not k.startswith("SLURM_")
    }
    env["OMP_NUM_THREADS"] = "1"  # fmt: skip
    cmd = [sys.executable, "-m", "flatshard.cli", "train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def _rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A: 40 steps then resumed to 50; B: 50 steps uninterrupted."""
    pytest.importorskip("flatshard.checkpoint", reason="flatshard.checkpoint not available")
    root = tmp_path_factory.mktemp("train")
    (root / "tiny.toml").write_text(TINY_TOML)
    config = ["--config", str(root / "tiny.toml"), "--nproc", "2", *OVERRIDES]
    first = _train(*config, "--steps", "40", "--out", str(root / "a"))
    assert first.returncode == 0, first.stderr[-3000:]
    first_rows = _rows(root / "a")
    resumed = _train(*config, "--steps", "50", "--out", str(root / "a"), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    whole = _train(*config, "--steps", "50", "--out", str(root / "b"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    return root, config, first, first_rows, resumed


def test_outputs_of_a_run(runs):
    root, config, first, first_rows, _ = runs
    a = root / "a"
    assert [r["step"] for r in first_rows] == list(range(1, 41))
    for row in first_rows:
        assert {"step", "loss", "tokens_per_s", "peak_mem_mb", "grad_norm", "lr"} <= set(row)
        assert row["tokens_per_s"] > 0 and row["peak_mem_mb"] > 0
    assert first_rows[-1]["loss"] < first_rows[0]["loss"] - 1.0  # it learns
    assert [r["step"] for r in first_rows if r.get("val_loss")] == [20, 40]
    for name in ("loss.png", "memory.png"):
        assert (a / name).stat().st_size > 1000
    # the log: a header, torchtitan-style lines, checkpoints, the sample
    assert "step    10 | loss" in first.stdout and "grad_norm" in first.stdout
    assert "checkpoint: " in first.stdout and "sample: 'Return the " in first.stdout
    # config.toml is the resolved config: --config OUT/config.toml reproduces the run
    written = load_toml(a / "config.toml")
    wanted, _ = parse_config([*config, "--steps", "50", "--out", str(a)])  # the resumed run
    assert written == resolve(wanted, cuda=False, local_world=2)


def test_resume_continues_the_same_curve(runs):
    root, *_, resumed = runs
    assert "resumed from" in resumed.stdout and "step_000040" in resumed.stdout
    a, b = _rows(root / "a"), _rows(root / "b")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 51))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # fp32, same world: exact
    assert [r.get("val_loss") for r in a] == [r.get("val_loss") for r in b]
    assert [r["lr"] for r in a] == [r["lr"] for r in b]
    kept = sorted(p.name for p in (root / "a" / "checkpoints").iterdir())
    assert kept == ["step_000040", "step_000050"]  # keep = 2


def test_fresh_run_into_old_checkpoints_is_refused(runs):
    root, config, *_ = runs
    done = _train(*config, "--steps", "5", "--out", str(root / "a"))
    assert done.returncode == 2
    assert "already holds checkpoints (newest step_000050); pass --resume" in done.stderr
