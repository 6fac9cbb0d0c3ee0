"""The step benchmark of ``bench/gpu_check.py``: the bare model, flatshard and torch FSDP2 at
world 1, interleaved, one row per precision.

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
from torch import nn

import flatshard as fs
from flatshard.models import GPT, Block, GPTConfig

PRECISIONS = ("fp32", "bf16")


def build_mode(mode: str, cfg: GPTConfig, device: torch.device, precision: str) -> nn.Module:
    """``mode``'s model in ``precision`` (seed 0 for every mode: the same initial weights)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    bf16 = precision == "bf16"
    if mode.startswith("flatshard"):
        mp = fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = fs.shard(model, policy=fs.wrap.by_type(Block), mixed_precision=mp if bf16 else None)
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


def timed_step(run: dict, x: torch.Tensor, cuda: bool) -> None:
    """One step; appends its seconds, its loss and its peak bytes above the step's start."""
    if cuda:
        torch.cuda.synchronize(), torch.cuda.reset_peak_memory_stats()
    start_mem = torch.cuda.memory_allocated() if cuda else 0
    t0 = time.perf_counter()
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
        model = build_mode(mode, cfg, device, precision)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        runs[mode] = {"model": model, "opt": opt, "ctx": _forward_ctx(mode, precision, device)}
        runs[mode].update(times=[], peaks=[], losses=[])
        timed_step(runs[mode], x, cuda)
        runs[mode]["resident"] = (torch.cuda.memory_allocated() - before) / 2**20 if cuda else 0
    return runs


def bench_row(device: torch.device, args: argparse.Namespace, precision: str, warmup=2) -> dict:
    """bare / flatshard / fsdp2 interleaved (order rotated per round); warm-up rounds dropped.
    Memory: ``resident`` = parameters + optimizer state (allocated after a first step);
    ``step_peak`` = the most a step allocates above that; their sum ~ the mode's peak alone."""
    cuda, modes = device.type == "cuda", ("bare", "flatshard", "fsdp2")
    modes += ("flatshard_compiled",) if args.compile else ()
    cfg = GPTConfig.preset(args.bench_model, max_seq_len=args.bench_seq)
    x = tokens(cfg.vocab_size, args.bench_batch, args.bench_seq, 3, device)
    runs = _build_runs(modes, cfg, device, precision, x)
    for i in range(warmup + args.bench_steps):
        for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
            timed_step(runs[mode], x, cuda)
    out: dict = {"model": args.bench_model, "params": cfg.num_params(), "precision": precision}
    out.update(batch=args.bench_batch, seq=args.bench_seq, modes={}, ratios={})
    times = {m: r["times"][1 + warmup :] for m, r in runs.items()}
    bare_losses = runs["bare"]["losses"]
    for mode, r in runs.items():
        m = {"median_s": statistics.median(times[mode]), "times_s": times[mode]}
        m.update(resident_mb=r["resident"], step_peak_mb=max(r["peaks"][1 + warmup :]) / 2**20)
        m["max_dloss_vs_bare"] = max(
            abs(a - b) for a, b in zip(r["losses"], bare_losses, strict=True)
        )
        out["modes"][mode] = m
    pairs = [("flatshard", "bare"), ("fsdp2", "bare"), ("flatshard", "fsdp2")]
    for a, b in pairs + ([("flatshard_compiled", "flatshard")] if args.compile else []):
        paired = statistics.median([p / q for p, q in zip(times[a], times[b], strict=True)])
        of_medians = out["modes"][a]["median_s"] / out["modes"][b]["median_s"]
        out["ratios"][f"{a}/{b}"] = {"of_medians": of_medians, "paired_median": paired}
    return out


def bench(device: torch.device, args: argparse.Namespace) -> dict[str, dict]:
    """One row per ``args.bench_precisions``; a row that dies keeps the others' results."""
    rows: dict[str, dict] = {}
    for precision in args.bench_precisions.split(","):
        try:
            rows[precision] = bench_row(device, args, precision)
            print_row(rows[precision], device.type == "cuda")
        except Exception:
            rows[precision] = {"error": traceback.format_exc()}
            say(f"\nFAIL  benchmark ({precision})\n" + rows[precision]["error"])
        gc.collect()  # the next row's resident memory is its own
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def print_row(b: dict, cuda: bool) -> None:
    steps, size = len(b["modes"]["bare"]["times_s"]), f"{b['params'] / 1e6:.0f}M params"
    say(f"\n== overhead at world 1, {b['precision']}: GPT {b['model']} ({size}), batch "
        f"{b['batch']}x{b['seq']}, {steps} timed steps per mode, interleaved")  # fmt: skip
    head = ("mode", "median ms", "resident MB", "step peak MB", "sum MB", "|dloss| vs bare")
    say("{:<19}{:>10}{:>13}{:>14}{:>9}{:>17}".format(*head))
    for mode, m in b["modes"].items():
        res, peak, d = m["resident_mb"], m["step_peak_mb"], m["max_dloss_vs_bare"]
        say(f"{mode:<19}{m['median_s'] * 1e3:>10.1f}{res:>13.0f}{peak:>14.0f}{res + peak:>9.0f}"
            f"{d:>17.2e}")  # fmt: skip
    if not cuda:
        say("(CPU dry run: no memory figures, and the times mean nothing)")
    for k, v in b["ratios"].items():
        say(f"{k:<29} of medians {v['of_medians']:.3f}   paired median {v['paired_median']:.3f}")
