"""The A/B of ``bench/gpu_check.py``: flatshard vs torch FSDP2 at world 1 (with the bare model
for scale), interleaved, one row per precision (default: bf16, GPT "1b" on a GPU).

Modes: ``bare``; ``flatshard`` (world 1 as a user gets it: no collective); ``flatshard_forced``
(the size-one group kept, ``gpu_check_forced``: real all-gathers and reduce-scatters on NCCL);
``flatshard_timed_wait`` (forced, and every wait passes a timeout as flatshard did before:
what the untimed NCCL wait saves); ``fsdp2`` (``fully_shard`` per block and on the root; at
world 1 torch's FSDP2 copies in and out but issues no collective: its counts say so);
``flatshard_compiled`` with ``--compile``. Each mode's collectives per step are counted.

- ``fp32``: fp32 parameters, compute and AdamW state in every mode (TF32 off on the GPU).
- ``bf16``: bf16 compute, fp32 gradient reduction, fp32 master weights and AdamW state, like
  for like: flatshard ``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)``, FSDP2
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` per block and on the root, the
  bare model with fp32 parameters and its forward under bf16 autocast.
The loss is computed in fp32 in every mode (``GPT.loss``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
import traceback

import torch
from gpu_check_common import lm_loss, say, tokens
from gpu_check_forced import Spy, forced_groups
from torch import nn

import flatshard as fs
import flatshard.comm.collectives as fs_coll
from flatshard.models import GPT, Block, GPTConfig

PRECISIONS = ("fp32", "bf16")
MODES = ("bare", "flatshard", "flatshard_forced", "flatshard_timed_wait", "fsdp2")
FORCED = ("flatshard_forced", "flatshard_timed_wait")


def build_mode(mode: str, cfg: GPTConfig, device: torch.device, precision: str) -> nn.Module:
    """``mode``'s model in ``precision`` (seed 0 for every mode: the same initial weights)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    bf16 = precision == "bf16"
    if mode.startswith("flatshard"):
        mp = fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        with forced_groups() if mode in FORCED else contextlib.nullcontext():
            model = fs.shard(
                model, policy=fs.wrap.by_type(Block), mixed_precision=mp if bf16 else None
            )
    if mode == "flatshard_compiled":  # hooks stay eager on __call__, block compute compiled
        for block in model.layers:
            block.forward = torch.compile(block.forward)
    if mode == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kwargs = {"mp_policy": policy} if bf16 else {}
        for block in model.layers:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
    return model


def _forward_ctx(mode: str, precision: str, device: torch.device):
    """The bare model's bf16: autocast around the forward (the sharded modes cast parameters)."""
    if mode == "bare" and precision == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


@contextlib.contextmanager
def timed_waits():
    """Every flatshard wait passes its timeout (the behaviour before the NCCL fix)."""
    original = fs_coll._bounded_wait
    fs_coll._bounded_wait = lambda work: True
    try:
        yield
    finally:
        fs_coll._bounded_wait = original


def step_ctx(mode: str):
    """What surrounds a whole step of ``mode`` (forward, backward, optimizer)."""
    return timed_waits if mode == "flatshard_timed_wait" else contextlib.nullcontext


def new_run(mode: str, cfg: GPTConfig, device: torch.device, precision: str) -> dict:
    """``mode``'s model, its AdamW and its contexts (see ``timed_step``)."""
    model = build_mode(mode, cfg, device, precision)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    run = {"model": model, "opt": opt, "ctx": _forward_ctx(mode, precision, device)}
    run.update(step_ctx=step_ctx(mode), times=[], peaks=[], losses=[])
    return run


def timed_step(run: dict, x: torch.Tensor, cuda: bool) -> None:
    """One step; appends its seconds, its loss and its peak bytes above the step's start."""
    if cuda:
        torch.cuda.synchronize(), torch.cuda.reset_peak_memory_stats()
    start_mem = torch.cuda.memory_allocated() if cuda else 0
    t0 = time.perf_counter()
    with run["step_ctx"]():
        with run["ctx"]():
            loss = lm_loss(run["model"], x)
        loss.backward()
        run["opt"].step(), run["opt"].zero_grad()
    run["losses"].append(loss.item())
    if cuda:
        torch.cuda.synchronize()
    run["times"].append(time.perf_counter() - t0)
    run["peaks"].append(torch.cuda.max_memory_allocated() - start_mem if cuda else 0)


def _build_runs(modes, cfg, device, precision, x) -> dict[str, dict]:
    """Every mode built, and its first step done (it creates the optimizer state)."""
    cuda, runs = device.type == "cuda", {}
    for mode in modes:
        before = torch.cuda.memory_allocated() if cuda else 0
        runs[mode] = new_run(mode, cfg, device, precision)
        timed_step(runs[mode], x, cuda)
        runs[mode]["resident"] = (torch.cuda.memory_allocated() - before) / 2**20 if cuda else 0
    return runs


def _count_collectives(runs: dict, x: torch.Tensor, cuda: bool) -> dict[str, dict]:
    """One more step of each mode under ``Spy``: its collectives per step (``op:device``)."""
    counts = {}
    for mode, run in runs.items():
        with Spy() as spy:
            timed_step(run, x, cuda)
        counts[mode] = spy.summary()
    return counts


RATIOS = [("flatshard_forced", "fsdp2"), ("flatshard", "fsdp2"), ("fsdp2", "bare")]
RATIOS += [("flatshard_forced", "bare"), ("flatshard_forced", "flatshard")]
RATIOS += [("flatshard_timed_wait", "flatshard_forced"), ("flatshard_compiled", "flatshard")]


def _summarise(runs: dict, times: dict, warmup: int) -> dict[str, dict]:
    """Per mode: median step, times, memory (resident + step peak = its peak alone)."""
    reference = runs["bare" if "bare" in runs else next(iter(runs))]["losses"]
    modes = {}
    for mode, r in runs.items():
        m = {"median_s": statistics.median(times[mode]), "times_s": times[mode]}
        m.update(resident_mb=r["resident"], step_peak_mb=max(r["peaks"][1 + warmup :]) / 2**20)
        m["peak_mb"] = m["resident_mb"] + m["step_peak_mb"]
        pairs = zip(r["losses"], reference, strict=True)  # every mode ran the same steps
        m["max_dloss_vs_bare"] = max(abs(a - b) for a, b in pairs)
        modes[mode] = m
    return modes


def bench_row(device: torch.device, args: argparse.Namespace, precision: str) -> dict:
    """The modes interleaved (order rotated per round); warm-up rounds dropped. Memory:
    ``resident`` = parameters + optimizer state (allocated after a first step); ``step_peak``
    = the most a step allocates above that (``max_memory_allocated``); ``peak`` = their sum,
    ~ the mode's peak alone (the modes share the GPU)."""
    cuda, modes = device.type == "cuda", tuple(args.ab_modes.split(","))
    modes += ("flatshard_compiled",) if args.compile else ()
    cfg = GPTConfig.preset(args.bench_model, max_seq_len=args.bench_seq)
    x = tokens(cfg.vocab_size, args.bench_batch, args.bench_seq, 3, device)
    runs = _build_runs(modes, cfg, device, precision, x)
    warmup = args.bench_warmup
    for i in range(warmup + args.bench_steps):
        for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
            timed_step(runs[mode], x, cuda)
    out: dict = {"model": args.bench_model, "params": cfg.num_params(), "precision": precision}
    out.update(batch=args.bench_batch, seq=args.bench_seq, ratios={})
    times = {m: r["times"][1 + warmup :] for m, r in runs.items()}
    out["modes"] = _summarise(runs, times, warmup)
    for mode, calls in _count_collectives(runs, x, cuda).items():
        out["modes"][mode]["collectives_per_step"] = calls
    for a, b in (p for p in RATIOS if p[0] in runs and p[1] in runs):
        paired = statistics.median([p / q for p, q in zip(times[a], times[b], strict=True)])
        of_medians = out["modes"][a]["median_s"] / out["modes"][b]["median_s"]
        out["ratios"][f"{a}/{b}"] = {"of_medians": of_medians, "paired_median": paired}
    out["ok"] = True
    return out


def bench(device: torch.device, args: argparse.Namespace) -> dict[str, dict]:
    """One row per ``args.bench_precisions``; a row that dies keeps the others' results."""
    rows: dict[str, dict] = {}
    for precision in args.bench_precisions.split(","):
        t0 = time.perf_counter()
        try:
            rows[precision] = bench_row(device, args, precision)
            rows[precision]["status"] = "pass"
            print_row(rows[precision], device.type == "cuda")
        except Exception:
            rows[precision] = {"ok": False, "status": "fail", "error": traceback.format_exc()}
            say(f"\nFAIL  A/B ({precision})\n" + rows[precision]["error"])
        rows[precision]["seconds"] = time.perf_counter() - t0
        gc.collect()  # the next row's resident memory is its own
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _calls(counts: dict) -> str:
    """``{"all_gather:cuda": 34, "all_reduce:cpu": 17}`` as ``ag 34 (host: ar 17)``: all-gather,
    reduce-scatter, all-reduce, broadcast; host (Gloo) ones apart, unless all are (dry run)."""
    short = {"all_gather": "ag", "reduce_scatter": "rs", "all_reduce": "ar", "broadcast": "bc"}
    dry = all(k.endswith(":cpu") for k in counts)
    device = [f"{short[k.split(':')[0]]} {n}" for k, n in counts.items() if dry or ":cpu" not in k]
    host = [f"{short[k.split(':')[0]]} {n}" for k, n in counts.items() if not dry and ":cpu" in k]
    return " ".join(device) + (f" (host: {' '.join(host)})" if host else "") or "none"


def print_row(b: dict, cuda: bool) -> None:
    first = next(iter(b["modes"].values()))
    steps, size = len(first["times_s"]), f"{b['params'] / 1e6:.0f}M params"
    say(f"\n== A/B at world 1, {b['precision']}: GPT {b['model']} ({size}), batch "
        f"{b['batch']}x{b['seq']}, {steps} timed steps per mode, interleaved")  # fmt: skip
    head = ("mode", "median ms", "resident MB", "step peak MB", "peak MB", "|dloss|", "calls")
    say("{:<22}{:>10}{:>13}{:>14}{:>9}{:>10}  {}".format(*head))
    for mode, m in b["modes"].items():
        res, peak, d = m["resident_mb"], m["step_peak_mb"], m["max_dloss_vs_bare"]
        say(f"{mode:<22}{m['median_s'] * 1e3:>10.1f}{res:>13.0f}{peak:>14.0f}{res + peak:>9.0f}"
            f"{d:>10.1e}  {_calls(m['collectives_per_step'])}")  # fmt: skip
    if not cuda:
        say("(CPU dry run: no memory figures, and the times mean nothing)")
    for k, v in b["ratios"].items():
        say(f"{k:<40} of medians {v['of_medians']:.3f}   paired median {v['paired_median']:.3f}")
