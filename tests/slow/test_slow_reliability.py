"""The full-size fault-injection runs of issue 8 (minutes, not seconds): skipped unless
``FLATSHARD_SLOW=1``, so the default ``pytest -q`` stays within its budget.

    FLATSHARD_SLOW=1 OMP_NUM_THREADS=1 .venv/bin/pytest -q tests/slow

Each wraps a script under bench/ (docs/reliability.md lists the measured figures).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "bench"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("FLATSHARD_SLOW") != "1", reason="set FLATSHARD_SLOW=1"),
]


def _bench(script: str, *args: str, timeout: float = 1200) -> dict:
    cmd = [sys.executable, str(BENCH / script), *args, "--json"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_killed_worker_5_trials_3_ranks():
    report = _bench("fault_kill.py", "--trials", "5", "--nproc", "3")
    s = report["summary"]
    assert s["max_exit_s"] < 60 and s["nonzero_exit"] == s["named"] == 5, report
    assert s["orphans"] == 0, report


def test_restarts_resume_identically_3_trials():
    report = _bench("fault_restart.py", "--trials", "3")
    assert report["summary"]["identical"] == 3, report


def test_interrupted_saves_20_trials():
    report = _bench("fault_save.py", "--trials", "20")
    assert report["summary"]["survived"] == 20, report


def test_soak_short():
    r = _bench("soak.py", "--steps", "150", "--every", "25", "--kills", "1")
    assert r["status"] == 0 and r["steps_logged"] == 150, r
    for w in r["workers"]:
        warm, end = w["warm"], w["end"]
        assert end["fds"] <= warm["fds"] and end["threads"] <= warm["threads"], w
        assert end["rss_mb"] <= warm["rss_mb"] * 1.05, w
    launcher = r["launcher"]
    assert launcher["end"]["fds"] <= launcher["warm"]["fds"] + 2, launcher
