"""flatshard on one GPU, one command: real NCCL collectives at world 1, delays, syncs, A/B.

Run by ``bench/gpu_check.sh`` (torchrun, one process, a global timeout of 7 minutes);
``python bench/gpu_check.py`` works too. With CUDA: NCCL, GPT "small" (fp32, TF32 off) for
the checks, GPT "1b" in bf16 for the A/B and the profile. Without CUDA (or ``--dry-run``, for
which gpu_check.sh hides the GPUs): a *dry run*, Gloo on the CPU with GPT "tiny", through the
same code; the CUDA-only parts are skipped with the reason, the timings mean nothing.

Sections, in this order (each skipped, with the reason, when the time left is short; the
JSON is rewritten after each, so a run that is killed keeps what it measured):

- ``env``: versions (torch and CI's pin, CUDA, NCCL, the GPU);
- ``wait_probe``: what ``wait(timeout)`` and ``wait()`` cost the host (gpu_check_probe.py);
- ``forced``: the size-one group kept (gpu_check_forced.py): bf16 + offload bit-identical to
  plain world 1; the same with each collective delayed on its stream and from a side stream;
  offload with ``fs.clip_grad_norm_``, the full optimizer state and ``fs.optim.Adafactor``;
- ``checks_forced`` / ``checks_plain``: parity, bf16, offload, pooled buffers, save/load, the
  activation-checkpointing routes, meta init (gpu_check_checks.py), with the size-one group
  kept (each must issue real collectives) and as world 1 is without it;
- ``sync_audit``: device synchronisations of one steady step, by flatshard line;
- ``ab``: flatshard (plain, forced, forced with timed waits) vs FSDP2 vs bare: step time,
  peak memory, collectives per step (gpu_check_bench.py);
- ``profiler``: compute-stream idle share, NCCL time, host time in ``PendingWork.wait``
  (gpu_check_profile.py).

Writes OUT/gpu_check.json (everything), OUT/gpu_check.md (the summary) and OUT/gpu_check.txt
(the report lines); exit status 1 when a section failed. docs/performance.md ("GPU check").
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import torch
import torch.distributed as dist
from gpu_check_bench import MODES, PRECISIONS, bench
from gpu_check_checks import checks_pass
from gpu_check_common import LINES, Ctx, run_checks, say, setup, status_of
from gpu_check_cp import check_torch_cp
from gpu_check_forced import FORCED_CHECKS, FORCED_WHAT
from gpu_check_probe import check_env, check_sync_audit, check_wait_probe
from gpu_check_profile import check_profiler
from gpu_check_report import markdown

from flatshard.comm.shutdown import end_process_group


def _profiler(c: Ctx, args) -> dict:
    def check_profiler_(c: Ctx) -> dict:
        return check_profiler(c, args)

    check_profiler_.__name__ = "check_profiler"
    return run_checks([check_profiler_], c)


# name, what it runs, the seconds it needs on an H200 (started only with that much time left)
SECTIONS = [
    ("env", lambda c, a: run_checks([check_env], c), 0),
    ("wait_probe", lambda c, a: run_checks([check_wait_probe], c), 10),
    ("forced", lambda c, a: run_checks(FORCED_CHECKS, c), 30),
    ("checks_forced", lambda c, a: checks_pass(c, forced=True), 45),
    ("sync_audit", lambda c, a: run_checks([check_sync_audit], c), 15),
    ("ab", lambda c, a: bench(c.device, a), 120),
    ("profiler", _profiler, 40),
    ("checks_plain", lambda c, a: checks_pass(c, forced=False), 35),
    ("torch_cp", lambda c, a: run_checks([check_torch_cp], c), 60),  # compiles FlexAttention
]
DRY_RUN_NEED = 0.2  # the CPU dry run's tiny sizes need about this share of those seconds


def parse_args() -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=".", help="folder for gpu_check.json, .md and .txt")
    p.add_argument("--dry-run", action="store_true", help="(gpu_check.sh hides the GPUs)")
    # --model/--batch/--seq: the checks' GPT preset and batch; --bench-*: the A/B's.
    gpu = dict(model="small", batch=4, seq=256, bench_model="1b", bench_batch=4, bench_seq=1024)
    cpu = dict(model="tiny", batch=2, seq=32, bench_model="tiny", bench_batch=1, bench_seq=32)
    steps = dict(bench_steps=15, bench_warmup=2, profile_steps=3) if cuda else {}
    steps = steps or dict(bench_steps=2, bench_warmup=1, profile_steps=2)
    for key, value in {**(gpu if cuda else cpu), **steps}.items():
        p.add_argument("--" + key.replace("_", "-"), type=type(value), default=value)
    p.add_argument("--bench-precisions", default="bf16",
                   help=f"A/B rows, comma-separated, of {', '.join(PRECISIONS)}")  # fmt: skip
    p.add_argument("--ab-modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    p.add_argument("--compile", action="store_true", help="A/B flatshard + compiled blocks too")
    names = [s[0] for s in SECTIONS]
    p.add_argument("--sections", default=",".join(names), help=f"of {', '.join(names)}")
    p.add_argument("--skip-bench", action="store_true", help="leave out ab and profiler")
    deadline = float(os.environ.get("GPU_CHECK_DEADLINE", 0))
    p.add_argument("--deadline", type=float, default=deadline,
                   help="epoch seconds by which the report is written (gpu_check.sh)")  # fmt: skip
    args = p.parse_args()
    for flag, value, allowed in (("--bench-precisions", args.bench_precisions, PRECISIONS),
                                 ("--ab-modes", args.ab_modes, MODES),
                                 ("--sections", args.sections, names)):  # fmt: skip
        unknown = set(value.split(",")) - set(allowed)
        if unknown:
            p.error(f"{flag}: unknown {sorted(unknown)}; choose among {', '.join(allowed)}")
    return args


def run_section(name: str, fn, need: float, c: Ctx, args, deadline: float) -> dict:
    """``fn``'s results with the section's status and seconds; skipped when fewer than
    ``need`` seconds are left before ``deadline``."""
    need *= 1.0 if c.cuda else DRY_RUN_NEED
    left = deadline - time.time()
    if left < need:
        say(f"\n== {name}: SKIPPED (budget: {left:.0f}s left, needs ~{need:.0f}s)")
        return {"status": "skip", "skipped": f"budget: {left:.0f}s left, needs ~{need:.0f}s"}
    say(f"\n== {name}")
    t0 = time.perf_counter()
    try:
        results = fn(c, args)
    except Exception:  # the other sections still run
        results = {name: {"ok": False, "status": "fail", "error": traceback.format_exc()}}
        say(results[name]["error"])
    out = {"status": status_of(results), "seconds": time.perf_counter() - t0, "checks": results}
    say(f"-- {name}: {out['status'].upper()} in {out['seconds']:.1f}s")
    return out


def write(report: dict, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(out_dir, "gpu_check.md"), "w") as f:
        f.write(markdown(report))
    with open(os.path.join(out_dir, "gpu_check.txt"), "w") as f:
        f.write("\n".join(LINES) + "\n")


def main() -> int:
    args = parse_args()
    t0, device = time.time(), setup()
    deadline = args.deadline or t0 + 400
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU: DRY RUN (no CUDA)"
    world = f"backend {dist.get_backend()}, world {dist.get_world_size()}"
    left = f"{deadline - t0:.0f}s left"
    say(f"== flatshard gpu_check: torch {torch.__version__}, {name}, {world}, {left}")
    c = Ctx(device, args.model, args.batch, args.seq)
    report: dict = {"device": name, "dry_run": not c.cuda, "torch": torch.__version__}
    report.update(forced_groups=FORCED_WHAT, args=vars(args), sections={})
    chosen = set(args.sections.split(",")) - ({"ab", "profiler"} if args.skip_bench else set())
    for section, fn, need in SECTIONS:
        if section in chosen:
            report["sections"][section] = run_section(section, fn, need, c, args, deadline)
            report["seconds"] = time.time() - t0
            write(report, args.out)
    failed = [s for s, r in report["sections"].items() if r["status"] == "fail"]
    report["ok"] = not failed
    say(f"\n{'ALL SECTIONS PASSED' if not failed else 'FAILED: ' + ', '.join(failed)}"
        f" in {time.time() - t0:.0f}s")  # fmt: skip
    report["seconds"] = time.time() - t0
    write(report, args.out)
    end_process_group()
    return 0 if not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
