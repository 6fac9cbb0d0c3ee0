"""``flatshard train`` end to end on 2 local CPU ranks: outputs, checkpoints, exact resume (and
one 1-rank run without matplotlib).

The CI check of issue 7: ``--steps 40 --nproc 2 --out DIR`` then ``--steps 50 --resume`` must
continue the very same curve as an uninterrupted 50-step run (fp32: equal losses). A tiny model
and short rows keep each run to a few seconds of training; most of the time is process start-up.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from flatshard.tools.train.cli import parse_config
from flatshard.tools.train.config_io import load_toml
from flatshard.tools.train.resolve import resolve

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
    cmd = [sys.executable, "-m", "flatshard.tools.cli", "train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def _rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A: 40 steps then resumed to 50; B: 50 steps uninterrupted."""
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


# The worker itself, in this one process (torchrun's variables for world 1), with matplotlib
# hidden: ``None`` in sys.modules makes every ``import matplotlib...`` raise ModuleNotFoundError.
_NO_MATPLOTLIB = (
    "import sys; sys.modules['matplotlib'] = None; "
    "from flatshard.tools.train.cli import main; sys.exit(main(sys.argv[1:]))"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_without_matplotlib_the_run_says_which_files_it_wrote(tmp_path):
    (tmp_path / "tiny.toml").write_text(TINY_TOML)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               OMP_NUM_THREADS="1")  # fmt: skip
    out = tmp_path / "out"
    args = ["--config", str(tmp_path / "tiny.toml"), "--steps", "4", "--out", str(out),
            "--checkpoint.enabled", "false", "--log.plot_every", "2"]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", _NO_MATPLOTLIB, *args],
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (out / "loss.png").exists() and not (out / "memory.png").exists()
    wrote = [line for line in done.stdout.splitlines() if "wrote " in line]
    assert len(wrote) == 1, done.stdout
    assert "loss.png" not in wrote[0].split(";")[0]  # not among the files written
    assert "metrics.jsonl" in wrote[0] and "config.toml" in wrote[0]
    assert "matplotlib is not installed" in wrote[0] and "flatshard[train]" in wrote[0]
    # the reason is given once during the run, not at every plot (steps 2 and 4)
    assert done.stdout.count("matplotlib is not installed") == 2, done.stdout
