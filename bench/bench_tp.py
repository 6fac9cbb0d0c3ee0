"""Step time and peak RSS of flatshard + TP vs torch FSDP2 + TP (dp x tp), interleaved.

    OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=65536 torchrun --nproc-per-node 4 \\
        bench/bench_tp.py [--tp 2] [--rounds 16] [--dim 256 --layers 2 --heads 4 --vocab 4096] \\
        [--batch 2 --seq 128] [--precisions fp32,bf16] [--json OUT.json]

Both engines train flatshard's GPT made tensor-parallel by ``parallelize_gpt`` (sequence
parallel on) on ``mesh["tp"]``, then data-parallel over ``mesh["dp"]``: flatshard
``fs.shard(model, policy=by_type(Block), mesh=mesh["dp"])``; FSDP2 ``fully_shard(block,
mesh=dp_mesh)`` per block, then on the root. Same seed, same batches (split by the dp rank:
the ranks of a tp group see the same rows). bf16: flatshard ``MixedPrecision(param_dtype=bf16,
reduce_dtype=fp32)``, FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``;
fp32 masters and AdamW state for both.

Time: per precision, ``--rounds`` rounds of one AdamW step per engine (order alternated), after
a barrier; a step takes its slowest rank's time; the first 2 rounds are dropped; ratios of
medians and medians of per-round ratios, flatshard/FSDP2. Memory: afterwards, each engine is
built alone (the other freed) and runs 3 steps; its peak RSS (``VmHWM``, reset through
``/proc/self/clear_refs`` before building) minus the RSS at that moment is the engine's cost on
that rank (model, gradients, optimizer state, activations, buffers); measured twice in the
order A B B A and the smaller kept; max over ranks. See docs/parallelism.md.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import flatshard as fs
from flatshard.comm.shutdown import end_process_group
from flatshard.models import GPT, Block, GPTConfig
from flatshard.models.tensor_parallel import parallelize_gpt
from flatshard.tools.bench import WARMUP, Runner, median, ratio_table, train_step

ENGINES = ("flatshard", "fsdp2")
PRECISIONS = ("fp32", "bf16")
MEMORY_STEPS = 3


def build(engine: str, precision: str, args: argparse.Namespace, mesh: DeviceMesh) -> Runner:
    """``engine``'s GPT (seeded alike), tensor-parallel then sharded, and its AdamW."""
    torch.manual_seed(args.seed)
    # Untied (a Llama's head): a tied TP head in a root of >= 1 MiB fails in backward today
    # (the lazy root's saved-tensor hooks miss the DTensor weight; see docs/parallelism.md).
    config = GPTConfig(vocab_size=args.vocab, d_model=args.d, n_layers=args.layers,
                       n_heads=args.heads, max_seq_len=args.seq, tie_embeddings=False)  # fmt: skip
    model = parallelize_gpt(GPT(config), mesh["tp"], sequence_parallel=True)
    bf16 = precision == "bf16"
    if engine == "flatshard":
        mp = fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fs.shard(model, policy=fs.wrap.by_type(Block), mesh=mesh["dp"],
                 mixed_precision=mp if bf16 else None)  # fmt: skip
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kwargs = {"mesh": mesh["dp"], "mp_policy": policy if bf16 else MixedPrecisionPolicy()}
        for block in model.layers:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
    return Runner(engine, model, torch.optim.AdamW(model.parameters(), lr=1e-3))


def batches(args: argparse.Namespace, mesh: DeviceMesh, n: int) -> list[torch.Tensor]:
    """``n`` batches ``[batch, seq + 1]`` of this dp rank (equal on every rank of its tp group)."""
    g = torch.Generator().manual_seed(1000 + mesh["dp"].get_local_rank())
    return [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g) for _ in range(n)]


def time_rounds(runners: list, xs: list[torch.Tensor], step=None) -> None:
    """One step per engine per round, order alternated; keep the slowest rank's times.
    ``step(runner, x)`` -> seconds (default: this script's ``train_step``)."""
    step = step or train_step
    for i, x in enumerate(xs):
        k = i % len(runners)
        for r in runners[k:] + runners[:k]:
            r.times.append(step(r, x))
    for r in runners:
        t = torch.tensor(r.times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        r.times = t.tolist()


def _status_kb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return float(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_over_start(make: Callable[[], Runner], xs: list[torch.Tensor]) -> float:
    """MB the process's peak RSS rises over its RSS now while ``make()`` builds a runner that
    steps on ``xs`` (freed afterwards)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    start = _status_kb("VmRSS")
    runner = make()
    for x in xs:
        train_step(runner, x)
    peak = _status_kb("VmHWM")
    del runner
    gc.collect()
    return (peak - start) / 1024


def measure_memory(
    precision: str, args: argparse.Namespace, mesh: DeviceMesh, xs: list[torch.Tensor]
) -> dict[str, list[float]]:
    """Engine -> per-rank MB (min over the A B B A passes)."""
    got: dict[str, list[float]] = {e: [] for e in ENGINES}
    for engine in (*ENGINES, *reversed(ENGINES)):
        got[engine].append(peak_over_start(lambda e=engine: build(e, precision, args, mesh), xs))
    return {e: _gather(min(v)) for e, v in got.items()}


def _gather(value: float) -> list[float]:
    out = torch.zeros(dist.get_world_size(), dtype=torch.float64)
    out[dist.get_rank()] = value
    dist.all_reduce(out)
    return out.tolist()


def run_precision(precision: str, args: argparse.Namespace, mesh: DeviceMesh) -> dict:
    """Timing rounds, then memory, for one precision; its figures."""
    runners = [build(e, precision, args, mesh) for e in ENGINES]
    time_rounds(runners, batches(args, mesh, args.rounds))
    fl, f2 = runners
    out = {
        "median_step_s": {r.name: median(r.times[WARMUP:]) for r in runners},
        "times_s": {r.name: r.times for r in runners},
        "max_loss_diff": max(abs(a - b) for a, b in zip(fl.losses, f2.losses, strict=True)),
        "ratios": ratio_table({r.name: r.times for r in runners})["flatshard/fsdp2"],
    }
    del runners, fl, f2
    rss = measure_memory(precision, args, mesh, batches(args, mesh, MEMORY_STEPS))
    out["peak_rss_over_start_mb"] = rss
    out["rss_ratio"] = max(rss["flatshard"]) / max(rss["fsdp2"])
    return out


def print_report(out: dict) -> None:
    c = out["config"]
    print(f"\n== bench_tp  world={out['world']} (dp {out['dp']} x tp {c['tp']})  "
          f"d={c['d']} L={c['layers']} H={c['heads']} V={c['vocab']}  "
          f"batch={c['batch']}x{c['seq']} per dp rank  rounds={c['rounds']} "
          f"(first {WARMUP} dropped)")  # fmt: skip
    cols = ("precision", "flatshard s", "FSDP2 s", "time ratio", "paired", "flatshard MB",
            "FSDP2 MB", "RSS ratio", "|dloss|")  # fmt: skip
    print("{:<10}{:>12}{:>9}{:>11}{:>8}{:>13}{:>10}{:>10}{:>10}".format(*cols))
    for p, r in out["precisions"].items():
        t, m = r["median_step_s"], r["peak_rss_over_start_mb"]
        print(f"{p:<10}{t['flatshard']:>12.3f}{t['fsdp2']:>9.3f}"
              f"{r['ratios']['of_medians']:>11.3f}{r['ratios']['paired_median']:>8.3f}"
              f"{max(m['flatshard']):>13.1f}{max(m['fsdp2']):>10.1f}{r['rss_ratio']:>10.3f}"
              f"{r['max_loss_diff']:>10.1e}")  # fmt: skip
    print(
        "time: median step (slowest rank); ratio = flatshard/FSDP2 of medians, paired = median"
        " of per-round ratios. MB: peak RSS over the RSS before building, max over ranks."
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (dp = world / tp)")
    p.add_argument("--rounds", "--steps", dest="rounds", type=int, default=16,
                   help=f"rounds per precision, incl. {WARMUP} warm-up")  # fmt: skip
    p.add_argument("--dim", "--d", dest="d", type=int, default=256)
    for name, default in (("layers", 2), ("heads", 4), ("vocab", 4096)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--batch", type=int, default=2, help="sequences per dp rank")
    p.add_argument("--seq", type=int, default=128, help="a multiple of --tp (sequence parallel)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precisions", default="fp32,bf16", help=", ".join(PRECISIONS))
    p.add_argument("--json", help="write every figure here")
    args = p.parse_args()
    args.precisions = [x for x in args.precisions.split(",") if x]
    if bad := [x for x in args.precisions if x not in PRECISIONS]:
        p.error(f"unknown --precisions {bad}; choose among {', '.join(PRECISIONS)}")
    if args.rounds <= WARMUP:
        p.error(f"--rounds must be > {WARMUP} (the warm-up rounds), got {args.rounds}")
    return args


def _return_freed_memory() -> None:
    """Large blocks mmapped, so a freed model leaves the RSS (as MALLOC_MMAP_THRESHOLD_=65536)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD


def main() -> None:
    args = parse_args()
    _return_freed_memory()
    # FSDP2's root returns the logits as a view; this loop never writes to them in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the world size {world}")
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    out = {"config": vars(args), "world": world, "dp": world // args.tp, "precisions": {}}
    for precision in args.precisions:
        out["precisions"][precision] = run_precision(precision, args, mesh)
    if dist.get_rank() == 0:
        print_report(out)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    end_process_group()


if __name__ == "__main__":
    main()
