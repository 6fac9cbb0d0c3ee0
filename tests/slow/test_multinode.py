"""Two torchrun agents on this machine stand in for two nodes (issue 37, goal 3): a clean
hybrid_shard run, a worker SIGKILLed under ``torchrun --max-restarts 1`` (every node's workers
restart and resume), and a whole "node" SIGKILLed (the survivor ends, naming the failure; the
job launched again resumes). Each resumed curve must equal the uninterrupted one step for step.
``bench/multinode.py`` does the work; its docstring says how to run more trials.

    FLATSHARD_SLOW=1 OMP_NUM_THREADS=1 .venv/bin/pytest -q tests/slow/test_multinode.py
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


def _bench(script: str, *args: str, timeout: float = 900) -> dict:
    cmd = [sys.executable, str(BENCH / script), *args, "--json"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # the script kills every process group it started, whatever happens (Job.kill)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_two_nodes_kill_and_resume_on_the_same_curve(tmp_path):
    r = _bench("multinode.py", "--kill", "both", "--trials", "1", "--root", str(tmp_path))
    worker, node = r["results"]
    assert worker["codes"] == [0, 0] and worker["resumed_from_step"], worker
    assert worker["same_curve"] and worker["max_loss_gap"] == 0.0, worker
    assert node["survivor_code"] not in (0, None), node  # it ended, and not as a success
    assert node["codes"] == [0, 0] and node["resumed_from_step"], node
    assert node["same_curve"] and node["max_loss_gap"] == 0.0, node


def test_a_library_script_on_two_nodes_matches_one_process():
    """``bench/multinode_script.py`` (fs.shard, hybrid_shard: shard within a "node", replicate
    across) under two torchrun agents x 2 workers: every step's loss equals an unsharded
    model's on the global batch."""
    sys.path.insert(0, str(BENCH))
    try:
        from multinode import free_port, kill_tree
    finally:
        sys.path.remove(str(BENCH))
    port = free_port()
    agent = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
        "--rdzv-id", f"lib{port}", "--rdzv-conf", "join_timeout=60",
        str(BENCH / "multinode_script.py"), "--steps", "3", "--check",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    agents = [
        subprocess.Popen(
            agent,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        for _ in range(2)
    ]
    try:
        outs = [a.communicate(timeout=300) for a in agents]
    finally:
        for a in agents:
            kill_tree(a.pid)
    assert [a.returncode for a in agents] == [0, 0], [err[-2000:] for _, err in outs]
    lines = [ln for out, _ in outs for ln in out.splitlines() if ln.startswith("{")]
    (report,) = [json.loads(ln) for ln in lines]
    assert report["world"] == 4 and report["mesh"] == {"replicate": 2, "shard": 2}, report
    assert len(report["losses"]) == 3 and max(report["gaps"]) < 1e-5, report
