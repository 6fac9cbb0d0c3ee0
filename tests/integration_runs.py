"""Shared by the integration test modules: one launch per module, both ranks' results.

The scripts under ``integrations/`` write ``OUT/rank<r>.json``; ``run_world2`` launches one
(the command builds its own launcher: Lightning's, or torchrun) with a clean environment and
returns both ranks' results; ``worst`` compares two loss curves.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).parent / "integrations"
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    with socket.socket() as sock:  # a default port may be taken by a parallel run
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_world2(launcher: list[str], script: str, out: Path, timeout: int = 300) -> list[dict]:
    """``launcher + [script, out]`` from ``out``, without any launch variables of ours."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [*launcher, str(SCRIPTS / script), str(out)]
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def run_lightning_ranks(script: str, out: Path, devices: int, *args: object) -> list[dict]:
    """``python script OUT DEVICES ARGS...`` from ``out`` as rank 0; Lightning's launcher
    starts the other ranks by running it again. Every rank's ``OUT/rank<r>.json``."""
    env = {k: v for k, v in os.environ.items() if k not in (*LAUNCH_ENV, "NODE_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, script, str(out), str(devices), *map(str, args)]
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(devices)]


def write_rank_result(out: Path, result: dict) -> None:
    """This rank's ``result`` as ``OUT/rank<LOCAL_RANK>.json`` (run_lightning_ranks reads it)."""
    rank = int(os.environ.get("LOCAL_RANK", 0))
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def torchrun() -> list[str]:
    port = str(free_port())
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", port]  # fmt: skip


def worst(a: list[float], b: list[float]) -> float:
    """The largest difference of two equally long, non-empty curves."""
    assert len(a) == len(b) and a, (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b, strict=True))
