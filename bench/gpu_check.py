"""World-1 checks of flatshard on one GPU, and its step overhead vs the bare model and FSDP2.

Run by ``bench/gpu_check.sh`` (torchrun, one process, a global timeout); ``python
bench/gpu_check.py`` works too. With CUDA: NCCL, GPT "small" in fp32 (TF32 off) for the checks,
"large" in bf16 for the benchmark. Without CUDA: a *dry run* (Gloo, CPU, GPT "tiny") through the
same code, whose timings mean nothing. At world 1 flatshard issues no collective, so this covers
the device paths (flat buffers, views, offload, pinned memory, checkpoint I/O), not NCCL traffic.
Checks: ``CHECKS`` below; benchmark: ``bench``; docs/performance.md ("GPU check") says what each
asserts and measures. Writes OUT/gpu_check.json and OUT/gpu_check.txt; exit status 1 on a failure.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import statistics
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn

import flatshard as fs
from flatshard.models import GPT, Block, GPTConfig

TOL = 1e-5
NOISE_FLOOR = 1e-5  # AdamW amplifies gradients at the rounding-noise level (docs/engine.md)
LINES: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def setup() -> torch.device:
    """One process: NCCL on the GPU (TF32 off), else Gloo on the CPU."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for key, value in {**env, "MASTER_PORT": "29517"}.items():
        os.environ.setdefault(key, value)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12) if b.numel() else 0.0


def tokens(cfg: GPTConfig, batch: int, seq: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g).to(device)


def lm_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x[:, :-1], labels=x[:, 1:])


def train(model: nn.Module, opt: torch.optim.Optimizer, *batches: torch.Tensor) -> list[float]:
    losses = []
    for x in batches:
        loss = lm_loss(model, x)
        loss.backward()
        opt.step(), opt.zero_grad()
        losses.append(loss.item())
    return losses


def step_parity(model: nn.Module, ref: nn.Module, x: torch.Tensor, x2: torch.Tensor) -> dict:
    """One AdamW step of both on ``x``, then a loss on ``x2``: the worst relative errors.
    At world 1 a fragment is the whole flattened parameter."""
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))
    loss, ref_loss = lm_loss(model, x), lm_loss(ref, x)
    loss.backward(), ref_loss.backward()
    params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
    assert params.keys() == ref_params.keys(), "parameter names differ"
    out = {"loss": rel_err(loss, ref_loss), "grad": 0.0, "params": 0.0, "noisy": 0}
    keep = {}
    for name, q in ref_params.items():
        g = q.grad.reshape(-1)
        out["grad"] = max(out["grad"], rel_err(params[name].grad, g))
        mag = g.abs()  # elements at the noise floor: left out of the parameter comparison
        keep[name] = ~((mag > 0) & (mag <= NOISE_FLOOR * mag.max()))
        out["noisy"] += int((~keep[name]).sum())
    opt.step(), ref_opt.step()
    for name, q in ref_params.items():
        mine = params[name][keep[name].to(params[name].device)]
        out["params"] = max(out["params"], rel_err(mine, q.reshape(-1)[keep[name]]))
    with torch.no_grad():
        out["next_loss"] = rel_err(lm_loss(model, x2), lm_loss(ref, x2))
    out["ok"] = all(out[k] <= TOL for k in ("loss", "grad", "params", "next_loss"))
    return out


class Ctx:
    """What every check needs: the device, a seeded base model on the CPU, two batches."""

    def __init__(self, device: torch.device, preset: str, batch: int, seq: int) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self.cfg = GPTConfig.preset(preset, max_seq_len=seq)
        torch.manual_seed(0)
        self.base = GPT(self.cfg)
        self.x, self.x2 = (tokens(self.cfg, batch, seq, s, device) for s in (1, 2))

    def ref(self) -> nn.Module:
        return copy.deepcopy(self.base).to(self.device)

    def sharded(self, **kwargs) -> nn.Module:
        return fs.shard(copy.deepcopy(self.base), policy=fs.wrap.by_type(Block), **kwargs)


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
CHECKS += [check_activation_ckpt, check_meta_init]


def run_checks(c: Ctx) -> dict:
    results = {}
    for fn in CHECKS:
        name, t0 = fn.__name__.removeprefix("check_"), time.perf_counter()
        try:
            r = fn(c)
        except Exception:  # report it and go on with the other checks
            r = {"ok": False, "error": traceback.format_exc()}
        r["seconds"] = time.perf_counter() - t0
        results[name] = r
        brief = [f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()]
        say(f"{'PASS' if r['ok'] else 'FAIL'}  {name:<16}{r['seconds']:6.1f}s  " + " ".join(
            b for b in brief if b.split("=")[0] not in ("ok", "error", "seconds")))  # fmt: skip
        if "error" in r:
            say(r["error"])
    return results


def build_mode(mode: str, cfg: GPTConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg).to(dtype)
    if mode.startswith("flatshard"):
        model = fs.shard(model, policy=fs.wrap.by_type(Block))
    if mode == "flatshard_compiled":  # hooks stay eager on __call__, block compute compiled
        for block in model.layers:
            block.forward = torch.compile(block.forward)
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
    return model


def timed_step(run: dict, x: torch.Tensor, cuda: bool) -> None:
    """One step; appends its seconds and its peak bytes above the step's start to ``run``."""
    if cuda:
        torch.cuda.synchronize(), torch.cuda.reset_peak_memory_stats()
    start_mem = torch.cuda.memory_allocated() if cuda else 0
    t0 = time.perf_counter()
    train(run["model"], run["opt"], x)
    if cuda:
        torch.cuda.synchronize()
    run["times"].append(time.perf_counter() - t0)
    run["peaks"].append(torch.cuda.max_memory_allocated() - start_mem if cuda else 0)


def bench(device: torch.device, args: argparse.Namespace, warmup: int = 2) -> dict:
    """bare / flatshard / fsdp2 interleaved (order rotated per round); warm-up rounds dropped.
    Memory: ``resident`` = parameters + optimizer state (allocated after a first step);
    ``step_peak`` = the most a step allocates above that; their sum ~ the mode's peak alone."""
    cuda, modes = device.type == "cuda", ("bare", "flatshard", "fsdp2")
    modes += ("flatshard_compiled",) if args.compile else ()
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = GPTConfig.preset(args.bench_model, max_seq_len=args.bench_seq)
    x = tokens(cfg, args.bench_batch, args.bench_seq, 3, device)
    runs: dict[str, dict] = {}
    for mode in modes:
        before = torch.cuda.memory_allocated() if cuda else 0
        model = build_mode(mode, cfg, device, dtype)
        runs[mode] = {"model": model, "opt": torch.optim.AdamW(model.parameters(), lr=1e-4)}
        runs[mode].update(times=[], peaks=[])
        timed_step(runs[mode], x, cuda)  # creates the optimizer state
        runs[mode]["resident"] = (torch.cuda.memory_allocated() - before) / 2**20 if cuda else 0
    for i in range(warmup + args.bench_steps):
        for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
            timed_step(runs[mode], x, cuda)
    out: dict = {"model": args.bench_model, "params": cfg.num_params(), "dtype": str(dtype)}
    out.update(batch=args.bench_batch, seq=args.bench_seq, modes={}, ratios={})
    times = {m: r["times"][1 + warmup :] for m, r in runs.items()}
    for mode, r in runs.items():
        out["modes"][mode] = {"median_s": statistics.median(times[mode]), "times_s": times[mode]}
        step_peak = max(r["peaks"][1 + warmup :]) / 2**20
        out["modes"][mode].update(resident_mb=r["resident"], step_peak_mb=step_peak)
    pairs = [("flatshard", "bare"), ("fsdp2", "bare"), ("flatshard", "fsdp2")]
    for a, b in pairs + ([("flatshard_compiled", "flatshard")] if args.compile else []):
        paired = statistics.median([p / q for p, q in zip(times[a], times[b], strict=True)])
        of_medians = out["modes"][a]["median_s"] / out["modes"][b]["median_s"]
        out["ratios"][f"{a}/{b}"] = {"of_medians": of_medians, "paired_median": paired}
    return out


def print_bench(b: dict, cuda: bool) -> None:
    steps, size = len(b["modes"]["bare"]["times_s"]), f"{b['params'] / 1e6:.0f}M params"
    say(f"\n== overhead at world 1: GPT {b['model']} ({size}, {b['dtype']}), batch "
        f"{b['batch']}x{b['seq']}, {steps} timed steps per mode, interleaved")  # fmt: skip
    say(f"{'mode':<19}{'median ms':>10}{'resident MB':>13}{'step peak MB':>14}{'sum MB':>9}")
    for mode, m in b["modes"].items():
        res, peak = m["resident_mb"], m["step_peak_mb"]
        say(f"{mode:<19}{m['median_s'] * 1e3:>10.1f}{res:>13.0f}{peak:>14.0f}{res + peak:>9.0f}")
    if not cuda:
        say("(CPU dry run: no memory figures, and the times mean nothing)")
    for k, v in b["ratios"].items():
        say(f"{k:<29} of medians {v['of_medians']:.3f}   paired median {v['paired_median']:.3f}")


def parse_args() -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=".", help="folder for gpu_check.json and gpu_check.txt")
    # --model/--batch/--seq: the checks' GPT preset and batch; --bench-*: the benchmark's.
    gpu = dict(model="small", batch=4, seq=256, bench_model="large", bench_batch=8, bench_seq=1024)
    cpu = dict(model="tiny", batch=2, seq=64, bench_model="tiny", bench_batch=2, bench_seq=64)
    for key, value in {**(gpu if cuda else cpu), "bench_steps": 20 if cuda else 4}.items():
        p.add_argument("--" + key.replace("_", "-"), type=type(value), default=value)
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--compile", action="store_true", help="bench flatshard + compiled blocks too")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    device = setup()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU: DRY RUN (no CUDA)"
    say(f"== flatshard gpu_check: torch {torch.__version__}, {name}, backend "
        f"{dist.get_backend()}, world {dist.get_world_size()}")  # fmt: skip
    t0 = time.perf_counter()
    checks = run_checks(Ctx(device, args.model, args.batch, args.seq))
    out: dict = {"device": name, "torch": torch.__version__, "checks": checks, "args": vars(args)}
    if not args.skip_bench:
        try:  # keep the checks' results if the benchmark dies (out of memory, ...)
            out["bench"] = bench(device, args)
            print_bench(out["bench"], device.type == "cuda")
        except Exception:
            out["bench"] = {"error": traceback.format_exc()}
            say("\nFAIL  benchmark\n" + out["bench"]["error"])
    passed, bench_ok = sum(r["ok"] for r in checks.values()), "error" not in out.get("bench", {})
    ok = passed == len(checks) and bench_ok
    note = "" if bench_ok else ", the benchmark FAILED"
    verdict = "ALL CHECKS PASSED" if ok else "SOME CHECKS FAILED"
    say(f"\n{verdict} ({passed}/{len(checks)}{note}) in {time.perf_counter() - t0:.0f}s")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    with open(os.path.join(args.out, "gpu_check.txt"), "w") as f:
        f.write("\n".join(LINES) + "\n")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
