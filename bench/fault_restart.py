"""A worker SIGKILLed under ``flatshard train --max-restarts 1``: the launcher restarts the
workers, they resume from the newest checkpoint, and the run ends exactly where an
uninterrupted one does (issue 8, item 2).

    OMP_NUM_THREADS=1 .venv/bin/python bench/fault_restart.py --trials 3

One uninterrupted reference run, then per trial a run whose random worker is killed at a random
step after the first checkpoint (every 10 steps). Compared with the reference: every row of
metrics.jsonl (loss, grad norm, lr, tokens, validation loss) and every tensor of the final
checkpoint (exported to safetensors), bit for bit (fp32, same world size).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import tempfile
import time
from pathlib import Path

import fault_common as fc

COMPARED = ("step", "loss", "grad_norm", "lr", "tokens", "val_loss", "skipped_steps")


def _command(inputs: list[str], out: Path, args: argparse.Namespace) -> list[str]:
    return [*inputs, "--steps", str(args.steps), "--nproc", str(args.nproc), "--out", str(out)]


def _final_weights(out: Path, steps: int) -> dict:
    from safetensors.torch import load_file

    from flatshard.checkpoint import export_checkpoint

    target = out / "final.safetensors"
    export_checkpoint(out / "checkpoints" / f"step_{steps:06d}", target)
    return load_file(target)


def _curve(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: json.loads(line).get(k) for k in COMPARED} for line in lines]


def reference(root: Path, inputs: list[str], args: argparse.Namespace) -> Path:
    out = root / "reference"
    proc = fc.start_train(_command(inputs, out, args), out)
    if proc.wait(timeout=300) != 0:
        raise RuntimeError(Path(f"{out}.err").read_text()[-2000:])
    return out


def trial(root: Path, inputs: list[str], index: int, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed * 1000 + index)
    out = root / f"restart{index}"
    proc = fc.start_train([*_command(inputs, out, args), "--max-restarts", "1"], out)
    after, victim = rng.randint(11, args.steps - 5), rng.randrange(args.nproc)
    fc.wait_for(f"step {after}", lambda: fc.rows(out) >= after, proc)
    fc.kill_workers(proc, victim, signal.SIGKILL)
    t0 = time.monotonic()
    status = proc.wait(timeout=300)
    stdout, stderr = Path(f"{out}.out").read_text(), Path(f"{out}.err").read_text()
    resumed = re.search(r"resumed from \S*step_(\d+)", stdout)
    result = {
        "victim": victim,
        "killed_after_step": after,
        "resumed_from_step": int(resumed.group(1)) if resumed else None,
        "status": status,
        "restart_note": f"rank {victim} was killed by SIGKILL; restarting" in stderr,
        "seconds_to_finish": round(time.monotonic() - t0, 1),
    }
    if status != 0:
        return {**result, "identical": False, "stderr": stderr[-1500:]}
    ref = root / "reference"
    same_curve = _curve(out) == _curve(ref)
    mine, theirs = _final_weights(out, args.steps), _final_weights(ref, args.steps)
    diff = max((mine[k] - theirs[k]).abs().max().item() for k in theirs)
    same_weights = mine.keys() == theirs.keys() and diff == 0.0
    return {**result, "same_curve": same_curve, "max_weight_diff": diff,
            "identical": same_curve and same_weights}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="fault_restart_") as tmp:
        root = Path(tmp)
        inputs = fc.write_inputs(root)
        reference(root, inputs, args)
        results = [trial(root, inputs, i, args) for i in range(args.trials)]
    summary = {"trials": len(results), "identical": sum(r["identical"] for r in results)}
    fc.report(results, summary, as_json=args.json)


if __name__ == "__main__":
    main()
