"""Shared pieces of the fault-injection scripts (``bench/fault_*.py``, ``bench/soak.py``) and of
``tests/test_reliability_*.py``: a tiny ``flatshard train`` run, its worker processes found
through ``/proc``, and waiting on them.

Workers are found as the launcher's children (``/proc/<pid>/task/*/children``) whose command
line is multiprocessing's ``spawn_main``; torch elastic starts them in local-rank order, so
sorting by start time gives rank order. Nothing in the trainer exists for these scripts.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

TINY_TOML = """
[model]
d_model = 32
n_layers = 2
n_heads = 2
dropout = 0.1
[data]
seq_len = 64
rows = 2
[precision]
param_dtype = "fp32"
[optim]
warmup_steps = 5
[checkpoint]
every = 10
keep = 2
[log]
every = 10
val_every = 0
val_batches = 1
plot_every = 0
sample_tokens = 0
"""
"""A 41K-parameter GPT, fp32 (exact resume), dropout on (the RNG state must be restored too)."""

_WORDS = "the of and to in is that for it with as was on be by this are from or have an"


def write_inputs(root: Path) -> list[str]:
    """A config file and a small JSONL corpus under ``root``; the options that use them."""
    import random

    root.mkdir(parents=True, exist_ok=True)
    (root / "tiny.toml").write_text(TINY_TOML)
    rng, words = random.Random(0), _WORDS.split()
    with open(root / "docs.jsonl", "w", encoding="utf-8") as f:
        for _ in range(400):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(5, 120)))
            f.write(json.dumps({"text": text}) + "\n")
    return ["--config", str(root / "tiny.toml"), "--data", str(root / "docs.jsonl")]


def clean_env() -> dict[str, str]:
    """This environment minus any launcher's worker variables (a plain ``flatshard train``)."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_train(args: list[str], timeout: float = 400) -> subprocess.CompletedProcess:
    """``flatshard train ARGS`` to its end (a plain launch: ``clean_env``), output captured."""
    cmd = [sys.executable, "-m", "flatshard.tools.cli", "train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), timeout=timeout)


def metrics(out: Path) -> list[dict]:
    """The rows of a run's ``metrics.jsonl``, in order."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_curve(got_rows: list[dict], want_rows: list[dict], tol: float = 1e-5) -> None:
    """Two runs' metrics rows equal step for step: loss, gradient norm and validation loss
    within ``tol`` (relative; 1e-5, fp32: the house bar for parity), token counts exactly."""
    assert len(got_rows) == len(want_rows) and all(math.isfinite(r["loss"]) for r in got_rows)
    for got, want in zip(got_rows, want_rows, strict=True):
        assert got["step"] == want["step"]
        for key in ("loss", "grad_norm", "val_loss"):
            if want.get(key) is not None:
                assert abs(got[key] - want[key]) <= tol * abs(want[key]), (key, got, want)
        assert got["tokens"] == want["tokens"]


def start_train(args: list[str], log: Path) -> subprocess.Popen:
    """``flatshard train ARGS`` in the background, stdout and stderr into ``log``.{out,err}."""
    cmd = [sys.executable, "-m", "flatshard.tools.cli", "train", *args]
    out, err = open(f"{log}.out", "w"), open(f"{log}.err", "w")  # noqa: SIM115 (closed by GC)
    return subprocess.Popen(cmd, stdout=out, stderr=err, env=clean_env())


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (all its threads' children), [] once it is gone."""
    found: list[int] = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        with contextlib.suppress(OSError):
            found += [int(x) for x in Path(path).read_text().split()]
    return found


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``."""
    todo, seen = [pid], set()
    while todo:
        for child in children(todo.pop()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state is [0]), None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def alive(pid: int) -> bool:
    """Running or sleeping (a zombie has exited already; its parent has not reaped it yet)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def workers(launcher: int) -> list[int]:
    """The launcher's worker processes in rank order (by start time)."""

    def is_worker(pid: int) -> bool:
        try:
            return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False

    found = [p for p in children(launcher) if is_worker(p)]
    return sorted(found, key=lambda p: (int((_stat(p) or ["0"] * 20)[19]), p))


def rows(out: Path) -> int:
    """Complete lines of ``out``/metrics.jsonl (the steps rank 0 has logged)."""
    try:
        return (out / "metrics.jsonl").read_bytes().count(b"\n")
    except OSError:
        return 0


def wait_for(
    what: str, test: Callable[[], bool], proc: subprocess.Popen, timeout: float = 180
) -> None:
    """Poll ``test`` every 10 ms; ``RuntimeError`` if ``proc`` exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while not test():
        if proc.poll() is not None:
            raise RuntimeError(f"flatshard train exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.01)


def kill_workers(launcher: subprocess.Popen, victim: int, sig: int = signal.SIGKILL) -> int:
    """Send ``sig`` to worker ``victim`` (rank); returns its pid."""
    pids = workers(launcher.pid)
    if len(pids) <= victim:
        raise RuntimeError(f"found {len(pids)} workers, wanted rank {victim}")
    os.kill(pids[victim], sig)
    return pids[victim]


def leftovers(pids: set[int], grace_s: float = 5.0) -> list[int]:
    """Those of ``pids`` still alive after ``grace_s`` (orphans)."""
    deadline = time.monotonic() + grace_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def report(results: list[dict], summary: dict, *, as_json: bool) -> None:
    """Print a fault script's trials and summary (one JSON object with ``--json``)."""
    if as_json:
        print(json.dumps({"results": results, "summary": summary}))
        return
    for i, r in enumerate(results):
        print(f"trial {i}: {json.dumps(r)}")
    print(json.dumps(summary))
