"""flatshard train's outputs and plumbing: metrics.jsonl, log lines, plots, schedule, launcher
environment, checkpoint retention -- everything that needs no worker processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from flatshard.tools.train.build import warmup_cosine
from flatshard.tools.train.checkpointing import CheckpointManager, refuse_to_mix
from flatshard.tools.train.config import OptimConfig
from flatshard.tools.train.launcher import first_host, launched_externally, slurm_environment
from flatshard.tools.train.metrics import (
    MetricsLog,
    format_line,
    peak_flops,
    peak_memory_mb,
    read_metrics,
)

REQUIRED = {"step", "loss", "tokens_per_s", "peak_mem_mb"}


def _row(step, loss=3.0, **extra):
    return {"step": step, "loss": loss, "grad_norm": 1.0, "lr": 1e-3, "tokens": 100,
            "tokens_per_s": 1234.5, "step_time_s": 0.1, "peak_mem_mb": 300.0, "mfu": None,
            **extra}  # fmt: skip


def _log(tmp_path, history=(), first_step=0):
    return MetricsLog(tmp_path, first_step=first_step, total_steps=10, log_every=5,
                      progress_bar=True, tensorboard=False, history=list(history))  # fmt: skip


def test_metrics_jsonl_rows_and_log_lines(tmp_path, capsys):
    log = _log(tmp_path)
    for step in range(1, 11):
        log.record(_row(step, loss=5.0 - step / 10, val_loss=2.5 if step == 10 else None))
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert all(set(r) >= REQUIRED for r in rows)
    out = capsys.readouterr().out.splitlines()  # not a TTY: no bar, plain lines
    assert [line.split("|")[0].strip() for line in out] == [
        "step     1",
        "step     5",
        "step    10",
    ]
    assert "val_loss 2.5000" in out[-1] and "tok/s     1,234" in out[-1]


def test_resumed_log_keeps_history_and_drops_later_rows(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(_row(s)) + "\n" for s in range(1, 8)) + '{"step": 8, "lo'
    )  # a crash after step 7 left a torn line; the checkpoint is at step 5
    history = read_metrics(tmp_path / "metrics.jsonl", upto=5)
    log = _log(tmp_path, history, first_step=5)
    log.record(_row(6, loss=1.0))
    log.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and rows[-1]["loss"] == 1.0


def test_format_line_shows_mfu_only_when_known():
    assert "mfu" not in format_line(_row(1))
    line = format_line(_row(1, mfu=0.4123), eta_s=75)
    assert "mfu 41.23%" in line and line.endswith("eta 1m15s")


def test_memory_and_peak_flops_on_cpu():
    assert peak_memory_mb(torch.device("cpu")) > 10
    assert peak_flops(torch.device("cpu")) is None


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    from flatshard.tools.train.plots import write_plots

    rows = [_row(s, loss=5 - s / 10, val_loss=4.0 if s % 5 == 0 else None) for s in range(1, 11)]
    assert write_plots(rows, tmp_path, title="t", memory_kind="peak RSS, CPU") == ""
    for name in ("loss.png", "memory.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*tmp"))


def test_import_flatshard_does_not_import_plotting():
    code = "import sys, flatshard; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_warmup_cosine_schedule():
    f = warmup_cosine(OptimConfig(warmup_steps=10, decay_steps=110, min_lr_ratio=0.1))
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55) and f(110) == pytest.approx(0.1)
    assert f(500) == pytest.approx(0.1)  # flat after decay_steps


def test_launch_environment_detection():
    assert launched_externally({"RANK": "0", "WORLD_SIZE": "2"}) == "torchrun"
    assert launched_externally({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}) is None  # sbatch
    srun = {"SLURM_PROCID": "3", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8",
            "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_JOB_ID": "1234",
            "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}  # fmt: skip
    assert launched_externally(srun) == "srun"
    env = slurm_environment(srun)
    assert env == {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "GROUP_RANK": "1",
                   "MASTER_ADDR": "gpu07", "MASTER_PORT": str(29500 + 1234),
                   "LOCAL_WORLD_SIZE": "4"}  # fmt: skip
    assert slurm_environment({**srun, "MASTER_PORT": "1111"})["MASTER_PORT"] == "1111"


@pytest.mark.parametrize(
    ("nodes", "host"),
    [("node1", "node1"), ("a[3-5,9],b1", "a3"), ("gpu[012,100]", "gpu012"), ("x1,x2", "x1")],
)
def test_first_host(nodes, host):
    assert first_host(nodes) == host


def test_checkpoint_retention_and_fresh_run_guard(tmp_path):
    manager = CheckpointManager(tmp_path, every=10, keep=2, async_save=False, rank=0)
    assert manager.due(10, 35) and manager.due(35, 35) and not manager.due(11, 35)
    for step in (10, 20, 100, 30):
        manager.path(step).mkdir()
    (tmp_path / "step_000040.tmp-abc").mkdir()  # a partial save is not a checkpoint
    assert [p.name for p in manager.existing()] == [f"step_{s:06d}" for s in (10, 20, 30, 100)]
    manager._prune()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_000030", "step_000040.tmp-abc", "step_000100"]  # fmt: skip
    with pytest.raises(ValueError, match=r"newest step_000100.*pass --resume"):
        refuse_to_mix(tmp_path)
    refuse_to_mix(tmp_path / "nothing_here")
