"""A worker SIGKILLed mid-run: how fast do the other workers and the launcher exit, and does the
output name the rank that died? (issue 8, item 1)

    OMP_NUM_THREADS=1 .venv/bin/python bench/fault_kill.py --trials 5 --nproc 3

Each trial starts ``flatshard train`` (tiny GPT, endless steps, checkpoints every 25), waits for
a random step in 5..40, SIGKILLs a random worker, and measures the time until every worker and
then the launcher are gone, the launcher's exit status, whether its stderr names the killed
rank, and whether any process of the job's tree is left. ``--signal STOP`` freezes the worker
instead (a hang, not a death: the others wait ``--timeout-s``, then fail).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import tempfile
import time
from pathlib import Path

import fault_common as fc


def trial(root: Path, inputs: list[str], index: int, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed * 1000 + index)
    out, log = root / f"kill{index}", root / f"kill{index}"
    cmd = [*inputs, "--steps", "100000", "--nproc", str(args.nproc), "--out", str(out)]
    cmd += ["--checkpoint.every", "25", "--log.every", "1000"]
    cmd += ["--parallel.timeout_s", str(args.timeout_s)]
    proc = fc.start_train(cmd, log)
    after, victim = rng.randint(5, 40), rng.randrange(args.nproc)
    fc.wait_for(f"step {after}", lambda: fc.rows(out) >= after, proc)
    tree = fc.descendants(proc.pid)
    workers = fc.workers(proc.pid)
    t0 = time.monotonic()
    fc.kill_workers(proc, victim, getattr(signal, f"SIG{args.signal}"))
    workers_gone_s = None
    while proc.poll() is None and time.monotonic() - t0 < args.limit_s:
        if workers_gone_s is None and not any(fc.alive(p) for p in workers):
            workers_gone_s = time.monotonic() - t0
        time.sleep(0.01)
    exit_s = time.monotonic() - t0
    if proc.poll() is None:
        proc.kill()
    err = Path(f"{log}.err").read_text()
    named = re.search(rf"rank ([\d, ]+): killed by SIG{args.signal}", err)
    orphans = fc.leftovers(tree)
    for pid in orphans:  # clean up after a failed trial
        os.kill(pid, signal.SIGKILL)
    return {
        "victim": victim,
        "at_step": after,
        "workers_gone_s": round(workers_gone_s or exit_s, 2),
        "exit_s": round(exit_s, 2),
        "status": proc.returncode,
        "named": bool(named and str(victim) in named.group(1).split(", ")),
        "orphans": orphans,
        "stderr": err.strip()[-600:],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--signal", choices=["KILL", "STOP"], default="KILL")
    p.add_argument("--timeout-s", type=float, default=600.0, help="parallel.timeout_s")
    p.add_argument("--limit-s", type=float, default=120.0, help="give up on a trial after this")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="fault_kill_") as tmp:
        root = Path(tmp)
        inputs = fc.write_inputs(root)
        results = [trial(root, inputs, i, args) for i in range(args.trials)]
    summary = {
        "trials": len(results),
        "max_exit_s": max(r["exit_s"] for r in results),
        "max_workers_gone_s": max(r["workers_gone_s"] for r in results),
        "nonzero_exit": sum(r["status"] not in (0, None) for r in results),
        "named": sum(r["named"] for r in results),
        "orphans": sum(len(r["orphans"]) for r in results),
    }
    if args.json:
        print(json.dumps({"results": results, "summary": summary}))
        return
    for i, r in enumerate(results):
        print(
            f"trial {i}: rank {r['victim']} at step {r['at_step']}: workers gone "
            f"{r['workers_gone_s']:.2f} s, launcher exit {r['exit_s']:.2f} s (status "
            f"{r['status']}), named {r['named']}, orphans {r['orphans']}"
        )
        print("    " + r["stderr"].splitlines()[-1] if r["stderr"] else "    (no stderr)")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
