"""bf16 vs fp32 training throughput of the reference GPT under flatshard, interleaved in one run.

Run: OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 bench/bench_precision.py \
         [--preset small] [--rows 4] [--seq 256] [--steps 10] [--json OUT]

Settings, each a separately sharded copy of the same model trained on the same batches, one
step of each per round (order rotated): fp32; bf16 compute + fp32 reduce; bf16 compute + bf16
reduce; fp32 compute + bf16 reduce. Reports median step time, tokens/s per rank, the ratio to
fp32, and flatshard's all-gather / reduce bytes per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flatshard as fs
from flatshard.comm.shutdown import end_process_group
from flatshard.models import GPT, Block, GPTConfig

SETTINGS = {
    "fp32": None,
    "bf16/fp32-reduce": fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "bf16/bf16-reduce": fs.MixedPrecision(param_dtype=torch.bfloat16),
    "fp32/bf16-reduce": fs.MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.bfloat16),
}


def build(
    preset: str, mp: fs.MixedPrecision | None
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset))
    if mp is not None:
        mp = fs.MixedPrecision(
            param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype, output_dtype=torch.float32
        )
    fs.shard(model, policy=fs.wrap.by_type(Block), mixed_precision=mp)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model, opt, batch: torch.Tensor) -> tuple[float, float]:
    dist.barrier()
    start = time.perf_counter()
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start, loss.item()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.steps < 3:
        p.error(f"--steps {args.steps}: at least 3 (the first 2 rounds are warm-up)")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    runs = {name: build(args.preset, mp) for name, mp in SETTINGS.items()}
    times = {name: [] for name in runs}
    comm = {}
    gen = torch.Generator().manual_seed(rank)
    for round_ in range(args.steps):
        batch = torch.randint(0, 256, (args.rows, args.seq + 1), generator=gen)
        names = list(runs)
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            model, opt = runs[name]
            fs.comm_stats(model, reset=True)
            seconds, _ = step(model, opt, batch)
            times[name].append(seconds)
            sent = fs.comm_stats(model).bytes
            comm[name] = {op: sent.get(op, 0) for op in ("all_gather", "reduce_scatter")}
    report(args, times, comm, rank)
    end_process_group()


def report(args, times: dict, comm: dict, rank: int) -> None:
    tokens = args.rows * args.seq
    med = {name: statistics.median(t[2:]) for name, t in times.items()}
    if rank == 0:
        head = ("setting", "median s", "tok/s/rank", "vs fp32", "gather MiB", "reduce MiB")
        print("{:18} {:>9} {:>11} {:>8} {:>11} {:>11}".format(*head))
        for name, m in med.items():
            gather, reduce = (comm[name][op] / 2**20 for op in ("all_gather", "reduce_scatter"))
            print(
                f"{name:18} {m:9.3f} {tokens / m:11.0f} {med['fp32'] / m:7.2f}x "
                f"{gather:11.2f} {reduce:11.2f}"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"median_s": med, "comm_bytes": comm, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
