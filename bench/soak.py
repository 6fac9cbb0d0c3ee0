"""Soak: a long ``flatshard train`` with checkpoints and random worker kills + restarts, watching
every process for leaks in memory (RSS), threads and open file descriptors (issue 8, item 7).

    OMP_NUM_THREADS=1 .venv/bin/python bench/soak.py --steps 500 --nproc 3 --kills 3

The run (tiny GPT, fp32, checkpoints every ``--every`` steps, ``--max-restarts`` = ``--kills``)
is sampled from outside every 0.25 s through ``/proc/<pid>/{status,fd}``: each worker process
(one per rank and incarnation) and the launcher. Kills land at random steps in the first 60% of
the run, so the last incarnation lives long. For each worker: its values once warm (the samples
between ``--every + 10`` and ``2 * --every + 10`` steps after it started: one checkpoint and its
allocations done) against its last samples while training; for the launcher (it lives through
every restart) its first samples after ``--every + 10`` steps against its last. Medians of 5.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import fault_common as fc

Sample = tuple[int, float, int, int]  # step, RSS MB, threads, open fds


def sample(pid: int, step: int) -> Sample | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if "VmRSS" not in fields:  # a process that is exiting (a zombie) has no memory left
        return None
    rss_mb = int(fields["VmRSS"].split()[0]) / 1024
    return step, rss_mb, int(fields["Threads"]), fds


def _median(samples: list[Sample]) -> dict:
    return {
        "step": samples[-1][0],
        "rss_mb": round(statistics.median(s[1] for s in samples), 1),
        "threads": statistics.median(s[2] for s in samples),
        "fds": statistics.median(s[3] for s in samples),
    }


def watch(proc, out: Path, args: argparse.Namespace, kills: list[int]) -> dict:
    """Sample until the launcher exits; kill a random worker at each step of ``kills``."""
    rng = random.Random(args.seed)
    workers: dict[int, list[Sample]] = defaultdict(list)
    ranks: dict[int, int] = {}
    launcher: list[Sample] = []
    done_kills = []
    while proc.poll() is None:
        step = fc.rows(out)
        pids = fc.workers(proc.pid)
        for rank, pid in enumerate(pids):
            ranks.setdefault(pid, rank)
            if (s := sample(pid, step)) is not None:
                workers[pid].append(s)
        if (s := sample(proc.pid, step)) is not None:
            launcher.append(s)
        if kills and step >= kills[0] and len(pids) == args.nproc:
            victim = rng.randrange(args.nproc)
            fc.kill_workers(proc, victim, signal.SIGKILL)
            done_kills.append({"step": step, "rank": victim})
            kills.pop(0)
        time.sleep(0.25)
    return {"workers": workers, "ranks": ranks, "launcher": launcher, "kills": done_kills}


def summarize(seen: dict, every: int, steps: int) -> dict:
    """Warm and end values of each process. "End" is the last samples while training (the
    final plots, sample and teardown change a process for reasons that are no leak)."""
    per_worker = []
    for pid, samples in seen["workers"].items():
        first = min(s[0] for s in samples)  # a restarted run rewrites metrics.jsonl
        warm = [s for s in samples if first + every + 10 <= s[0] <= first + 2 * every + 10][:5]
        training = [s for s in samples if s[0] < steps]
        if len(warm) < 3:
            continue  # killed (or finished) before it was warm
        curve = [(t[0], t[1]) for t in training[:: max(1, len(training) // 8)]]
        per_worker.append({"rank": seen["ranks"][pid], "from_step": first, "warm": _median(warm),
                           "end": _median(training[-5:]), "rss_curve": curve})  # fmt: skip
    launcher = [s for s in seen["launcher"] if s[0] < steps]
    warm = [s for s in launcher if s[0] >= every + 10][:5]
    return {
        "kills": seen["kills"],
        "workers": per_worker,
        "launcher": {"warm": _median(warm), "end": _median(launcher[-5:])},
    }


def soak(root: Path, args: argparse.Namespace) -> dict:
    inputs = fc.write_inputs(root)
    out = root / "soak"
    cmd = [*inputs, "--steps", str(args.steps), "--nproc", str(args.nproc), "--out", str(out)]
    cmd += ["--checkpoint.every", str(args.every), "--max-restarts", str(args.kills)]
    cmd += ["--log.every", "100", "--checkpoint.async_save", str(args.async_save).lower()]
    rng = random.Random(args.seed)
    kills = sorted(rng.sample(range(args.every + 20, int(0.6 * args.steps)), args.kills))
    t0 = time.monotonic()
    proc = fc.start_train(cmd, root / "soak")
    seen = watch(proc, out, args, kills)
    result = summarize(seen, args.every, args.steps)
    final = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    leftovers = sorted(p.name for p in (out / "checkpoints").iterdir())
    result.update(
        status=proc.returncode,
        seconds=round(time.monotonic() - t0, 1),
        steps_logged=len(final),
        final_loss=final[-1]["loss"] if final else None,
        checkpoints_left=leftovers,
        stderr=Path(f"{root / 'soak'}.err").read_text()[-1500:],
    )
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--nproc", type=int, default=3)
    p.add_argument("--every", type=int, default=50, help="checkpoint every this many steps")
    p.add_argument("--kills", type=int, default=3, help="random worker kills (and restarts)")
    p.add_argument("--async-save", action="store_true", help="checkpoint.async_save = true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="soak_") as tmp:
        result = soak(Path(tmp), args)
    if args.json:
        print(json.dumps(result))
        return
    print(f"status {result['status']} in {result['seconds']} s, {result['steps_logged']} steps, "
          f"final loss {result['final_loss']}, kills {result['kills']}")  # fmt: skip
    print(f"checkpoints left: {result['checkpoints_left']}")
    for w in result["workers"]:
        a, b = w["warm"], w["end"]
        print(f"rank {w['rank']} (from step {w['from_step']}): step {a['step']} -> {b['step']}: "
              f"RSS {a['rss_mb']} -> {b['rss_mb']} MB, threads {a['threads']} -> "
              f"{b['threads']}, fds {a['fds']} -> {b['fds']}")  # fmt: skip
    a, b = result["launcher"]["warm"], result["launcher"]["end"]
    print(f"launcher: RSS {a['rss_mb']} -> {b['rss_mb']} MB, threads {a['threads']} -> "
          f"{b['threads']}, fds {a['fds']} -> {b['fds']}")  # fmt: skip


if __name__ == "__main__":
    main()
