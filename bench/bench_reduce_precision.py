"""Gradient reduction under bf16 compute: fp32 reduce, bf16 reduce, bf16 wire + fp32 sum.

Run: OMP_NUM_THREADS=1 .venv/bin/python bench/bench_reduce_precision.py \
         [--worlds 2 4 8] [--dim 512] [--layers 4] [--rows 8] [--steps 6] [--json OUT]
         [--gloo-collectives]

For each world size, ranks are spawned on Gloo (CPU, ``torch.multiprocessing``) and one MLP of
``--layers`` ``Linear(dim, dim)`` units (``fs.wrap.by_type(nn.Linear)``) is sharded three ways,
all with ``param_dtype=bf16``:
  fp32 reduce          ``reduce_dtype=fp32``: an fp32 reduce-scatter (today's default for it)
  bf16 reduce          ``reduce_dtype=bf16``: a bf16 reduce-scatter, summed in bf16
  bf16 wire+fp32 sum   ``reduce_dtype=fp32``, ``fs.Comm(reduce="bf16")``: a bf16 all-to-all,
                       summed in fp32 where it arrives
Reported per setting: the gradient bytes this rank sent per step (``fs.comm_stats``:
reduce-scatter or all-to-all), the median forward+backward time (steps interleaved across the
settings, order rotated), both as ratios to fp32 reduce, and the largest error of the sharded
gradient against the fp64 sum of the ranks' local gradients (relative to its largest element,
the worst rank). Gloo groups of 2..8 ranks use flatshard's point-to-point transport (the fp32
and bf16 reduce-scatter a ring, the bf16 wire direct sends); ``--gloo-collectives`` measures
Gloo's own collectives instead. Timings on a shared CPU box are noisy: compare ratios within
one run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import flatshard as fs
from flatshard.comm.shutdown import end_process_group

SETTINGS = {
    "fp32 reduce": (torch.float32, None),
    "bf16 reduce": (torch.bfloat16, None),
    "bf16 wire+fp32 sum": (torch.float32, "bf16"),
}
GRAD_OPS = ("reduce_scatter", "all_to_all")


def build(args) -> nn.Module:
    torch.manual_seed(0)
    layers = [m for _ in range(args.layers) for m in (nn.Linear(args.dim, args.dim), nn.GELU())]
    return nn.Sequential(*layers)


def shard(args, setting: str) -> nn.Module:
    reduce_dtype, wire = SETTINGS[setting]
    mp_ = fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    return fs.shard(
        build(args),
        policy=fs.wrap.by_type(nn.Linear),
        mixed_precision=mp_,
        comm=fs.Comm(reduce=wire),
    )


def local_batch(args) -> torch.Tensor:
    g = torch.Generator().manual_seed(dist.get_rank())
    return torch.randn(args.rows, args.dim, generator=g)


def backward(model: nn.Module, batch: torch.Tensor) -> None:
    (model(batch.bfloat16()).float().square().mean() * 100.0).backward()


def fp64_reference(args, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    """The mean over ranks of the local bf16 gradients, summed in fp64."""
    plain = build(args).to(torch.bfloat16)
    backward(plain, batch)
    out = {}
    for name, p in plain.named_parameters():
        g = p.grad.double().reshape(-1)
        dist.all_reduce(g)
        out[name] = g / dist.get_world_size()
    return out


def error(model: nn.Module, ref: dict[str, torch.Tensor]) -> float:
    """Largest |sharded - fp64| over this model, relative to the fp64 gradient's largest."""
    worst, scale = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for name, info in fs.fragment_info(model).items():
        start, end = info.flat_range
        scale = torch.maximum(scale, ref[name].abs().max())
        if end > start:
            diff = info.fragment.grad.double() - ref[name][start:end]
            worst = torch.maximum(worst, diff.abs().max())
    both = torch.stack([worst, scale])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return (both[0] / both[1]).item()


def measure(args) -> dict:
    batch = local_batch(args)
    ref = fp64_reference(args, batch)
    models = {s: shard(args, s) for s in SETTINGS}
    result = {s: {"times": []} for s in SETTINGS}
    for s, model in models.items():  # one step each: bytes and error
        fs.comm_stats(model, reset=True)
        backward(model, batch)
        sent = fs.comm_stats(model).bytes
        result[s]["grad_bytes"] = sum(sent.get(op, 0) for op in GRAD_OPS)
        result[s]["err_vs_fp64"] = error(model, ref)
        model.zero_grad(set_to_none=True)
    names = list(SETTINGS)
    for step in range(args.steps):
        for s in names[step % len(names) :] + names[: step % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            backward(models[s], batch)
            models[s].zero_grad(set_to_none=True)
            result[s]["times"].append(time.perf_counter() - start)
    for r in result.values():
        times = torch.tensor(r.pop("times"), dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        r["step_ms"] = statistics.median(times.tolist()[1:] or times.tolist()) * 1e3
    return result


def worker(rank: int, world: int, port: int, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    os.environ["FLATSHARD_GLOO_P2P"] = "0" if args.gloo_collectives else "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = measure(args)
        if rank == 0:
            out.put(result)
    finally:
        end_process_group()


def run_world(world: int, args) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    result = out.get(timeout=1800)
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"world {world}: a rank exited with {p.exitcode}")
    return result


def table(rows: dict[int, dict]) -> str:
    lines = [
        "| world | setting | grad bytes/step/rank | bytes vs fp32 | step ms | time vs fp32 "
        "| max rel err vs fp64 |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for world, result in rows.items():
        base = result["fp32 reduce"]
        for s, r in result.items():
            ratio = r["grad_bytes"] / base["grad_bytes"]
            lines.append(
                f"| {world} | {s} | {r['grad_bytes']:,} | {ratio:.2f}"
                f" | {r['step_ms']:.1f} | {r['step_ms'] / base['step_ms']:.2f}"
                f" | {r['err_vs_fp64']:.1e} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--gloo-collectives",
        action="store_true",
        help="FLATSHARD_GLOO_P2P=0: Gloo's own collectives (all-to-all, all-reduce) throughout",
    )
    args = p.parse_args()
    rows = {world: run_world(world, args) for world in args.worlds}
    print(table(rows), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(w): r for w, r in rows.items()}, f, indent=1)


if __name__ == "__main__":
    main()
