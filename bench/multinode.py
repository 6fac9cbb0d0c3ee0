"""Two torchrun agents on this machine stand in for two nodes (issue 37, goal 3).

    OMP_NUM_THREADS=1 .venv/bin/python bench/multinode.py --trials 3 [--nproc 2] [--kill both]

Both agents run ``torchrun --nnodes 2 --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint
localhost:PORT -m flatshard.tools.cli train --parallel.strategy hybrid_shard`` on a fresh port
(their node ranks come from the rendezvous). First one uninterrupted reference run (``--resume``,
which starts from step 0); then per trial, after a random step past the first checkpoint:

* ``--kill worker``: one worker SIGKILLed under ``--max-restarts 1``, without ``--resume``: the
  restarted workers of both nodes must resume by themselves;
* ``--kill node``: one agent and its workers SIGKILLed (a lost machine): the survivor must end
  non-zero; then the same job is launched again with ``--resume``.

Every trial's logged curve (loss, grad norm, lr, tokens, step by step) must equal the
reference's. Every process group started here is SIGKILLed at the end (``Job.kill``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


import fault_common as fc

COMPARED = ("step", "loss", "grad_norm", "lr", "tokens")
JOB_TIMEOUT_S = 300.0


def free_port() -> int:
    """A port nobody listens on now (the c10d rendezvous host binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_command(port: int, nproc: int, train_args: list[str], restarts: int) -> list[str]:
    """One "node": a torchrun agent joining the two-node c10d rendezvous at ``port``."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
        "--rdzv-id", f"job{port}", "--rdzv-conf", "join_timeout=60",
        "--max-restarts", str(restarts), "--monitor-interval", "0.2",
        "-m", "flatshard.tools.cli", "train", *train_args,
    ]  # fmt: skip


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every process below it (a node's sudden death)."""
    below = fc.descendants(pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for child in below:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signal.SIGKILL)


class Job:
    """Two agents started together, each in its own session (so a "node" dies as a whole)."""

    def __init__(self, out: Path, nproc: int, train_args: list[str], restarts: int) -> None:
        self.out, port = out, free_port()
        env = {**fc.clean_env(), "LOGLEVEL": "INFO", "FLATSHARD_ATTEMPT_LOG": "1"}
        self.agents: list[subprocess.Popen] = []
        for node in range(2):
            log = open(f"{out}.node{node}.log", "a")  # noqa: SIM115 (closed with the process)
            cmd = agent_command(port, nproc, train_args, restarts)
            self.agents.append(
                subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            )

    def wait(self, timeout: float = JOB_TIMEOUT_S) -> list[int | None]:
        """Both agents' exit statuses; after ``timeout`` what is left is killed (None)."""
        deadline = time.monotonic() + timeout
        for a in self.agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                a.wait(timeout=max(deadline - time.monotonic(), 0.1))
        codes = [a.poll() for a in self.agents]
        self.kill()
        return codes

    def kill(self) -> None:
        """SIGKILL every process group still there (agents and their workers): no orphans."""
        for a in self.agents:
            kill_tree(a.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                a.wait(timeout=10)

    def workers(self, node: int) -> list[int]:
        """The worker processes of ``node``'s agent (they run flatshard.tools.cli)."""

        def is_worker(pid: int) -> bool:
            try:
                return b"flatshard.tools.cli" in Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                return False

        return sorted(p for p in fc.children(self.agents[node].pid) if is_worker(p))

    def log(self, node: int) -> str:
        return Path(f"{self.out}.node{node}.log").read_text(errors="replace")

    def wait_rows(self, rows: int, timeout: float = JOB_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while fc.rows(self.out) < rows:
            if any(a.poll() is not None for a in self.agents) or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"no step {rows} logged: {self.log(0)[-1500:]}")
            time.sleep(0.02)


def curve(out: Path) -> list[dict]:
    """metrics.jsonl's compared columns; a resumed run rewrites the rows after its checkpoint."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: r.get(k) for k in COMPARED} for r in rows]


def max_loss_gap(mine: list[dict], ref: list[dict]) -> float | None:
    """The largest loss difference step for step, None if the steps logged differ."""
    if [r["step"] for r in mine] != [r["step"] for r in ref]:
        return None
    return max(abs(a["loss"] - b["loss"]) for a, b in zip(mine, ref, strict=True))


def train_args(
    inputs: list[str], out: Path, args: argparse.Namespace, resume: bool = True
) -> list[str]:
    """``flatshard train``'s options; without ``resume`` only a restart may resume."""
    return [
        *inputs, "--out", str(out), "--steps", str(args.steps),
        "--parallel.strategy", "hybrid_shard", "--parallel.backend", "gloo",
        "--parallel.timeout_s", str(args.timeout_s), "--checkpoint.every", str(args.every),
        "--log.every", "1", *(["--resume"] if resume else []),
    ]  # fmt: skip


def reference(root: Path, inputs: list[str], args: argparse.Namespace) -> dict:
    out = root / "reference"
    t0 = time.monotonic()
    job = Job(out, args.nproc, train_args(inputs, out, args), restarts=0)
    codes = job.wait()
    return {"codes": codes, "seconds": round(time.monotonic() - t0, 1), "out": out, "job": job}


def kill_worker_trial(root: Path, inputs: list[str], i: int, args: argparse.Namespace) -> dict:
    """A worker SIGKILLed; torchrun --max-restarts 1 restarts every node's workers."""
    rng = random.Random(args.seed * 1000 + i)
    out = root / f"worker{i}"
    node, after = rng.randrange(2), rng.randint(args.every + 1, args.steps - 3)
    # no --resume: the restarted workers must resume by themselves, on every node
    job = Job(out, args.nproc, train_args(inputs, out, args, resume=False), restarts=1)
    job.wait_rows(after)
    victims = job.workers(node)
    os.kill(rng.choice(victims), signal.SIGKILL)
    codes = job.wait()
    logs = job.log(0) + job.log(1)
    resumed = re.search(r"resumed from \S*step_(\d+)", logs)
    return {
        "node": node, "killed_after_step": after, "codes": codes,
        "resumed_from_step": int(resumed.group(1)) if resumed else None,
        "init_failures": logs.count("connectFullMesh"),
        **_compare(out, root, codes, logs),
    }  # fmt: skip


def kill_node_trial(root: Path, inputs: list[str], i: int, args: argparse.Namespace) -> dict:
    """A whole "node" (agent and workers) SIGKILLed: the survivor must end, naming the lost
    rank; the same command launched again resumes from the newest checkpoint."""
    rng = random.Random(args.seed * 1000 + i)
    out = root / f"node{i}"
    node, after = rng.randrange(2), rng.randint(args.every + 1, args.steps - 3)
    job = Job(out, args.nproc, train_args(inputs, out, args), restarts=0)
    job.wait_rows(after)
    t0 = time.monotonic()
    kill_tree(job.agents[node].pid)
    codes = job.wait(timeout=args.timeout_s + 120)
    survivor = job.log(1 - node)
    ended = {"survivor_code": codes[1 - node], "survivor_exit_s": round(time.monotonic() - t0, 1)}
    ended["names_peer"] = bool(re.search(r"rank \d+|peer|closed|reset", survivor))
    again = Job(out, args.nproc, train_args(inputs, out, args), restarts=0)
    codes2 = again.wait()
    logs = again.log(0) + again.log(1)
    resumed = re.search(r"resumed from \S*step_(\d+)", logs)
    return {
        "node": node, "killed_after_step": after, **ended, "codes": codes2,
        "resumed_from_step": int(resumed.group(1)) if resumed else None,
        "survivor_tail": survivor[-600:], **_compare(out, root, codes2, logs),
    }  # fmt: skip


def _compare(out: Path, root: Path, codes: list, logs: str) -> dict:
    if codes != [0, 0]:
        return {"same_curve": False, "tail": logs[-2500:]}
    mine, ref = curve(out), curve(root / "reference")
    gap = max_loss_gap(mine, ref)
    return {"same_curve": mine == ref, "max_loss_gap": gap, "rows": len(mine)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--kill", choices=("worker", "node", "both"), default="worker")
    p.add_argument("--nproc", type=int, default=1, help="workers per node")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=5, help="checkpoint interval")
    p.add_argument("--timeout-s", type=float, default=60.0, help="parallel.timeout_s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--root", type=Path, default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    root = args.root or Path(tempfile.mkdtemp(prefix="flatshard-multinode-"))
    inputs = fc.write_inputs(root)
    ref = reference(root, inputs, args)
    if ref["codes"] != [0, 0]:
        raise SystemExit(f"reference run failed {ref['codes']}: {ref['job'].log(0)[-3000:]}")
    kinds = {"worker": [kill_worker_trial], "node": [kill_node_trial]}
    trials = kinds.get(args.kill, [kill_worker_trial, kill_node_trial])
    results = [t(root, inputs, i, args) for i in range(args.trials) for t in trials]
    summary = {
        "kill": args.kill, "nproc_per_node": args.nproc, "trials": len(results),
        "reference_s": ref["seconds"], "same_curve": sum(r["same_curve"] for r in results),
        "root": str(root),
    }  # fmt: skip
    fc.report(results, summary, as_json=args.json)


if __name__ == "__main__":
    main()
