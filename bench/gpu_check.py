"""World-1 checks of flatshard on one GPU, and its step overhead vs the bare model and FSDP2.

Run by ``bench/gpu_check.sh`` (torchrun, one process, a global timeout); ``python
bench/gpu_check.py`` works too. With CUDA: NCCL, GPT "small" in fp32 (TF32 off) for the checks,
"large" for the benchmark (an fp32 row and a bf16 mixed-precision row). Without CUDA: a *dry
run* (Gloo, CPU, GPT "tiny") through the same code, whose timings mean nothing. At world 1
flatshard issues no collective, so this covers the device paths (flat buffers, views, offload,
pinned memory, checkpoint I/O), not NCCL traffic. Checks: ``CHECKS`` below (activation
checkpointing by every torch and Hugging Face route: ``gpu_check_routes.py``); benchmark:
``gpu_check_bench.py``; docs/performance.md ("GPU check") says what each asserts and measures.
Writes OUT/gpu_check.json and OUT/gpu_check.txt (every check: pass, fail or skip, and its
numbers); exit status 1 on a failure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
from gpu_check_bench import PRECISIONS, bench
from gpu_check_common import LINES, TOL, Ctx, lm_loss, rel_err, say, setup, step_parity, train
from gpu_check_routes import ROUTE_CHECKS

import flatshard as fs
from flatshard.comm.shutdown import end_process_group
from flatshard.models import GPT, Block


def check_fp32_parity(c: Ctx) -> dict:
    return step_parity(c.sharded(), c.ref(), c.x, c.x2)


def check_bf16_mixed(c: Ctx) -> dict:
    mp = fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = c.sharded(mixed_precision=mp)
    losses = train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), c.x, c.x2, c.x)
    with torch.no_grad():
        fp32 = lm_loss(c.ref(), c.x).item()
    fp32_frags = all(p.dtype == torch.float32 for p in model.parameters())
    ok = all(math.isfinite(v) for v in losses) and fp32_frags
    ok &= abs(losses[0] - fp32) <= 0.02 * abs(fp32)  # bf16 forward ~ fp32 forward
    return {"ok": ok, "losses": losses, "fp32_loss": fp32, "fp32_fragments": fp32_frags}


def check_cpu_offload(c: Ctx) -> dict:
    model = c.sharded(offload=fs.CPUOffload(params=True))
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    pinned = all(p.is_pinned() for p in model.parameters()) if c.cuda else None  # CUDA only
    out = step_parity(model, c.ref(), c.x, c.x2)
    out.update(on_cpu=on_cpu, pinned=pinned, ok=out["ok"] and on_cpu and pinned is not False)
    return out


def check_pooled_buffers(c: Ctx) -> dict:
    """Reused gather buffers + saved-view hooks on the device: with offloaded shards the full
    buffers are separate tensors even at world 1, so the pool serves them; 3 SGD steps, the
    gradients of each equal the unsharded model's (from step 2 on a block's backward regather
    lands in another buffer than its forward's)."""
    model, ref = c.sharded(offload=fs.CPUOffload(params=True)), c.ref()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
    errs = []
    for x in (c.x, c.x2, c.x):
        lm_loss(model, x).backward(), lm_loss(ref, x).backward()
        errs.append(max(rel_err(params[n].grad, q.grad.reshape(-1)) for n, q in ref_params.items()))
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    allocations = fs.memory_stats(model).pool_allocations
    # CPU dry run: offloading to the CPU is a no-op there, so world 1 has no buffer to pool.
    pooled = allocations > 0 or not c.cuda
    return {"ok": max(errs) <= TOL and pooled, "grad_errs": errs, "buffers": allocations}


def check_save_load(c: Ctx) -> dict:
    """Save after a step; load into another init that has optimizer state of its own."""
    model = c.sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, c.x)
    torch.manual_seed(1)
    other = fs.shard(GPT(c.cfg), policy=fs.wrap.by_type(Block))
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    train(other, other_opt, c.x2)
    with tempfile.TemporaryDirectory() as tmp:
        fs.save(os.path.join(tmp, "ckpt"), model=model, optimizer=opt, extra={"step": 1})
        extra = fs.load(os.path.join(tmp, "ckpt"), model=other, optimizer=other_opt)
    a, b = fs.full_state_dict(model), fs.full_state_dict(other)
    sd_diff = max((a[k] - b[k]).abs().max().item() for k in a)
    mine, theirs = (o.state_dict()["state"].values() for o in (opt, other_opt))
    pairs = [(s[k], t[k]) for s, t in zip(mine, theirs, strict=True) for k in s]
    opt_diff = max((s.float() - t.float()).abs().max().item() for s, t in pairs)
    with torch.no_grad():
        losses = [lm_loss(m, c.x2).item() for m in (model, other)]
    ok = sd_diff == 0 and opt_diff == 0 and extra.get("step") == 1 and losses[0] == losses[1]
    return {"ok": ok, "state_dict_diff": sd_diff, "optimizer_diff": opt_diff, "losses": losses}


def check_activation_ckpt(c: Ctx) -> dict:
    model = c.sharded()
    fs.checkpoint_activations(model, fs.wrap.by_type(Block))
    return step_parity(model, c.ref(), c.x, c.x2)


def check_meta_init(c: Ctx) -> dict:
    with torch.device("meta"):
        model = GPT(c.cfg)
    model = fs.shard(model, policy=fs.wrap.by_type(Block))
    tensors = [*model.parameters(), *model.buffers()]
    placed = all(t.device.type == c.device.type for t in tensors)
    finite = all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())
    losses = train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), c.x, c.x2)
    uniform = math.log(c.cfg.vocab_size)  # a small-init GPT starts near the uniform loss
    ok = placed and finite and abs(losses[0] - uniform) < 0.1 * uniform and losses[1] < 1e9
    return {"ok": ok, "on_device": placed, "finite": finite, "losses": losses, "ln_V": uniform}


CHECKS = [check_fp32_parity, check_bf16_mixed, check_cpu_offload, check_pooled_buffers]
CHECKS += [check_save_load]
CHECKS += [check_activation_ckpt, *ROUTE_CHECKS, check_meta_init]


def run_check(fn, c: Ctx) -> dict:
    """``fn(c)`` with its ``status`` (pass, fail, or skip when it returns ``skipped``: why) and
    its seconds; an exception is a failure with its traceback."""
    t0 = time.perf_counter()
    try:
        r = fn(c)
    except Exception:  # report it and go on with the other checks
        r = {"ok": False, "error": traceback.format_exc()}
    if "skipped" in r:
        r["ok"], r["status"] = None, "skip"
    else:
        r["status"] = "pass" if r["ok"] else "fail"
    r["seconds"] = time.perf_counter() - t0
    return r


def run_checks(c: Ctx) -> dict:
    results = {}
    for fn in CHECKS:
        name = fn.__name__.removeprefix("check_")
        r = results[name] = run_check(fn, c)
        brief = [f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()]
        quiet = ("ok", "status", "error", "seconds")
        say(f"{r['status'].upper():<4}  {name:<26}{r['seconds']:6.1f}s  " + " ".join(
            b for b in brief if b.split("=")[0] not in quiet))  # fmt: skip
        if "error" in r:
            say(r["error"])
    return results


def parse_args() -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=".", help="folder for gpu_check.json and gpu_check.txt")
    # --model/--batch/--seq: the checks' GPT preset and batch; --bench-*: the benchmark's.
    gpu = dict(model="small", batch=4, seq=256, bench_model="large", bench_batch=8, bench_seq=1024)
    cpu = dict(model="tiny", batch=2, seq=64, bench_model="tiny", bench_batch=2, bench_seq=64)
    for key, value in {**(gpu if cuda else cpu), "bench_steps": 20 if cuda else 4}.items():
        p.add_argument("--" + key.replace("_", "-"), type=type(value), default=value)
    p.add_argument("--bench-precisions", default=",".join(PRECISIONS),
                   help=f"benchmark rows, comma-separated, of {', '.join(PRECISIONS)}")  # fmt: skip
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--compile", action="store_true", help="bench flatshard + compiled blocks too")
    args = p.parse_args()
    unknown = set(args.bench_precisions.split(",")) - set(PRECISIONS)
    if unknown:
        p.error(f"--bench-precisions: unknown {sorted(unknown)}; choose among {PRECISIONS}")
    return args


def verdict(checks: dict, rows: dict) -> tuple[bool, str]:
    """Whether everything that ran passed, and the closing line's counts."""
    count = {s: sum(r["status"] == s for r in checks.values()) for s in ("pass", "fail", "skip")}
    failed_rows = [p for p, row in rows.items() if "error" in row]
    ok = count["fail"] == 0 and not failed_rows
    line = f"{'ALL CHECKS PASSED' if ok else 'SOME CHECKS FAILED'} ({count['pass']}/{len(checks)}"
    line += f", {count['skip']} skipped" if count["skip"] else ""
    line += f", the benchmark FAILED ({', '.join(failed_rows)})" if failed_rows else ""
    return ok, line + ")"


def main() -> int:
    args = parse_args()
    device = setup()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU: DRY RUN (no CUDA)"
    say(f"== flatshard gpu_check: torch {torch.__version__}, {name}, backend "
        f"{dist.get_backend()}, world {dist.get_world_size()}")  # fmt: skip
    t0 = time.perf_counter()
    checks = run_checks(Ctx(device, args.model, args.batch, args.seq))
    out: dict = {"device": name, "torch": torch.__version__, "checks": checks, "args": vars(args)}
    if not args.skip_bench:  # a row that dies (out of memory, ...) keeps the rest
        out["bench"] = bench(device, args)
    ok, line = verdict(checks, out.get("bench", {}))
    say(f"\n{line} in {time.perf_counter() - t0:.0f}s")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    with open(os.path.join(args.out, "gpu_check.txt"), "w") as f:
        f.write("\n".join(LINES) + "\n")
    end_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
