"""Step time and peak RSS of flatshard vs torch FSDP2 stages under Schedule1F1B (pp x dp).

    OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=65536 torchrun --nproc-per-node 4 \\
        bench/bench_pp.py [--pp 2] [--rounds 12] [--dim 256 --layers 4 --heads 4 --vocab 4096] \\
        [--microbatches 4 --rows 1 --seq 64] [--strategy full_shard] [--json OUT.json]

A GPT (flatshard's ``Block``: attention + SwiGLU, RoPE) cut into ``--pp`` stages: the embedding
on the first, norm + untied head on the last, ``--layers / --pp`` blocks each. Every rank builds
the mesh ``(pp, dp)``, keeps the stage of its pp coordinate and shards it over ``mesh["dp"]``:
flatshard ``fs.shard(stage, policy=by_type(Block), mesh=dp, strategy=--strategy)``, each step in
``fs.pipeline_step(schedule)`` (one reduce-scatter per unit per step); FSDP2 ``fully_shard(block,
mesh=dp, reshard_after_forward=False)`` per block then on the stage (torchtitan's setting under
PP; torch's stage skips the gradient sync until the last microbatch). Same seed, same batches
(split by the dp rank), AdamW, fp32.

Time: ``--rounds`` rounds of one step (``schedule.step`` + AdamW) per engine, order alternated,
after a barrier; a step takes its slowest rank's time; the first 2 rounds are dropped; ratios of
medians and medians of per-round ratios, flatshard/FSDP2. Memory: afterwards each engine is
built alone (the other freed) and runs 3 steps; its peak RSS (``VmHWM``, reset through
``/proc/self/clear_refs``) over the RSS before building it, per rank, min over the passes
A B B A. Also: flatshard's reduce-scatters and all-gathers per unit per step (steady state, max
over ranks) and the largest loss difference between the engines. See docs/parallelism.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_tp import _gather, _return_freed_memory, _status_kb, time_rounds
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import flatshard as fs
from flatshard.comm.shutdown import end_process_group
from flatshard.models import Block, GPTConfig
from flatshard.models.rope import RotaryEmbedding
from flatshard.tools.bench import WARMUP, median, ratio_table

ENGINES = ("flatshard", "fsdp2")
MEMORY_STEPS = 3


class Stage(nn.Module):
    """One pipeline stage of the GPT: embedding on the first, norm + head on the last."""

    def __init__(self, config: GPTConfig, first: bool, last: bool, blocks: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model) if first else None
        self.rope = RotaryEmbedding(config.head_dim, config.max_seq_len, config.rope_theta)
        self.layers = nn.ModuleList(Block(config) for _ in range(blocks))
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps) if last else None
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            x = self.tok_emb(x)  # [B, T] -> [B, T, C]
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)  # [1, T]
        cos, sin = self.rope(positions)
        for layer in self.layers:
            x = layer(x, cos, sin)  # [B, T, C]
        return self.head(self.norm(x)) if self.head is not None else x  # [B, T, V] on the last


@dataclass
class Runner:
    """One engine on this rank: its stage module, schedule, optimizer and what it measured."""

    name: str
    module: Stage
    schedule: Schedule1F1B
    opt: torch.optim.Optimizer
    pp_rank: int
    n_stages: int
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    comm: list[dict[str, float]] = field(default_factory=list)
    keep_gathered: bool = False  # flatshard: fs.pipeline_step(keep_gathered=...)


def config_of(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, d_model=args.d, n_layers=args.layers,
                     n_heads=args.heads, max_seq_len=args.seq, tie_embeddings=False)  # fmt: skip


def build(engine: str, args: argparse.Namespace, mesh: DeviceMesh) -> Runner:
    """``engine``'s stage of this pp rank (seeded alike for both engines), sharded
    over dp, its ``PipelineStage``, ``Schedule1F1B`` and AdamW."""
    pp, n_stages = mesh["pp"].get_local_rank(), mesh["pp"].size()
    config = config_of(args)
    torch.manual_seed(args.seed + pp)  # only this stage is built: nothing else in the peak
    module = Stage(config, pp == 0, pp == n_stages - 1, args.layers // n_stages)
    if engine == "flatshard":
        fs.shard(module, policy=fs.wrap.by_type(Block), mesh=mesh["dp"], strategy=args.strategy)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in module.layers:
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
        fully_shard(module, mesh=mesh["dp"], reshard_after_forward=False)
    stage = PipelineStage(module, pp, n_stages, torch.device("cpu"), group=mesh["pp"].get_group())
    vocab = args.vocab

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))

    schedule = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    keep = engine == "flatshard" and args.keep_gathered
    return Runner(engine, module, schedule, opt, pp, n_stages, keep_gathered=keep)


def batches(args: argparse.Namespace, mesh: DeviceMesh, n: int) -> list[torch.Tensor]:
    """``n`` batches ``[microbatches * rows, seq + 1]`` of this dp rank (alike over pp)."""
    g = torch.Generator().manual_seed(1000 + mesh["dp"].get_local_rank())
    rows = args.microbatches * args.rows
    return [torch.randint(0, args.vocab, (rows, args.seq + 1), generator=g) for _ in range(n)]


def _units(module: nn.Module) -> int:
    """flatshard's reductions a step needs at least: one per bucket, one per other unit."""
    units = fs.units(module)
    buckets = {u.bucket for u in units if u.bucket is not None}
    return len(buckets) + sum(1 for u in units if u.bucket is None and u.numel)


def train_step(r: Runner, x: torch.Tensor) -> float:
    """One pipeline step and AdamW step after a barrier; the seconds it took on this rank."""
    flat = r.name == "flatshard"
    if flat:
        fs.comm_stats(r.module, reset=True)
    first, last = r.pp_rank == 0, r.pp_rank == r.n_stages - 1
    losses: list[torch.Tensor] = []
    kwargs = {"target": x[:, 1:], "losses": losses} if last else {}
    args = (x[:, :-1],) if first else ()
    dist.barrier()
    t0 = time.perf_counter()
    keep = r.keep_gathered
    with fs.pipeline_step(r.schedule, keep_gathered=keep) if flat else contextlib.nullcontext():
        r.schedule.step(*args, **kwargs)
    r.opt.step()
    r.opt.zero_grad(set_to_none=True)
    dt = time.perf_counter() - t0
    r.losses.append(torch.stack(losses).mean().item() if last else 0.0)
    if flat:
        calls, n = fs.comm_stats(r.module).calls, _units(r.module)
        r.comm.append({k: calls.get(k, 0) / n for k in ("reduce_scatter", "all_gather")})
    return dt


def peak_over_start(engine: str, args: argparse.Namespace, mesh: DeviceMesh) -> float:
    """MB this process's peak RSS rises over its RSS now while ``engine`` is built and steps
    ``MEMORY_STEPS`` times (freed afterwards)."""
    xs = batches(args, mesh, MEMORY_STEPS)
    gc.collect()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    start = _status_kb("VmRSS")
    runner = build(engine, args, mesh)
    for x in xs:
        train_step(runner, x)
    peak = _status_kb("VmHWM")
    del runner
    gc.collect()
    return (peak - start) / 1024


def measure_memory(args: argparse.Namespace, mesh: DeviceMesh) -> dict[str, list[float]]:
    """Engine -> per-rank MB (min over the A B B A passes)."""
    got: dict[str, list[float]] = {e: [] for e in ENGINES}
    for engine in (*ENGINES, *reversed(ENGINES)):
        got[engine].append(peak_over_start(engine, args, mesh))
    return {e: _gather(min(v)) for e, v in got.items()}


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _ratio(a: float, b: float) -> float:
    """``a / b``, nan when ``b`` is 0 (a tiny model's peak may not rise over the RSS at all)."""
    return a / b if b else float("nan")


def run(args: argparse.Namespace, mesh: DeviceMesh) -> dict:
    """Timing rounds, then memory; the figures."""
    runners = [build(e, args, mesh) for e in ENGINES]
    time_rounds(runners, batches(args, mesh, args.rounds), step=train_step)
    fl, f2 = runners
    steady = fl.comm[-1]
    out = {
        "median_step_s": {r.name: median(r.times[WARMUP:]) for r in runners},
        "times_s": {r.name: r.times for r in runners},
        "ratios": ratio_table({r.name: r.times for r in runners})["flatshard/fsdp2"],
        "max_loss_diff": _max_over_ranks(
            max(abs(a - b) for a, b in zip(fl.losses, f2.losses, strict=True))
        ),
        "flatshard_per_unit_step": {k: _max_over_ranks(v) for k, v in steady.items()},
        "last_loss": _max_over_ranks(fl.losses[-1]),  # the last stage's; 0 elsewhere
    }
    del runners, fl, f2
    rss = measure_memory(args, mesh)
    out["peak_rss_over_start_mb"] = rss
    out["rss_ratio_per_rank"] = [_ratio(a, b) for a, b in zip(*rss.values(), strict=True)]
    out["rss_ratio"] = _ratio(max(rss["flatshard"]), max(rss["fsdp2"]))
    return out


def print_report(out: dict) -> None:
    c, r = out["config"], out["result"]
    print(f"\n== bench_pp  world={out['world']} (pp {c['pp']} x dp {out['dp']})  Schedule1F1B "
          f"microbatches={c['microbatches']}x{c['rows']}x{c['seq']} per dp rank  d={c['d']} "
          f"L={c['layers']} H={c['heads']} V={c['vocab']}  flatshard {c['strategy']}  "
          f"rounds={c['rounds']} "
          f"(first {WARMUP} dropped)")  # fmt: skip
    t, ratios, per_unit = r["median_step_s"], r["ratios"], r["flatshard_per_unit_step"]
    print(f"step s: flatshard {t['flatshard']:.3f}  FSDP2 {t['fsdp2']:.3f}  "
          f"flatshard/FSDP2 {ratios['of_medians']:.3f} (medians), "
          f"{ratios['paired_median']:.3f} (paired)  |dloss| {r['max_loss_diff']:.1e}")  # fmt: skip
    print(f"flatshard per unit per step: reduce-scatters {per_unit['reduce_scatter']:g}, "
          f"all-gathers {per_unit['all_gather']:g}")  # fmt: skip
    print("{:<6}{:>4}{:>4}{:>14}{:>10}{:>11}".format(
        "rank", "pp", "dp", "flatshard MB", "FSDP2 MB", "RSS ratio"))  # fmt: skip
    m, dp = r["peak_rss_over_start_mb"], out["dp"]
    for rank, ratio in enumerate(r["rss_ratio_per_rank"]):
        print(f"{rank:<6}{rank // dp:>4}{rank % dp:>4}{m['flatshard'][rank]:>14.1f}"
              f"{m['fsdp2'][rank]:>10.1f}{ratio:>11.3f}")  # fmt: skip
    print(f"max over ranks: RSS flatshard/FSDP2 {r['rss_ratio']:.3f}")
    print(
        "time: median step (schedule.step + AdamW, slowest rank); paired = median of per-round"
        " ratios. MB: peak RSS over the RSS before building, min of 2 passes."
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (dp = world / pp)")
    p.add_argument("--rounds", type=int, default=12, help=f"rounds, incl. {WARMUP} warm-up")
    p.add_argument("--dim", "--d", dest="d", type=int, default=256)
    for name, default in (("layers", 4), ("heads", 4), ("vocab", 4096)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--microbatches", type=int, default=4, help="per step (>= --pp for 1F1B)")
    p.add_argument("--rows", type=int, default=1, help="sequences per microbatch per dp rank")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strategy", default="full_shard", choices=("full_shard", "shard_grad_op"),
                   help="flatshard's (shard_grad_op: kept gathered after forward)")  # fmt: skip
    p.add_argument("--keep-gathered", action="store_true",
                   help="flatshard: fs.pipeline_step(keep_gathered=True), as FSDP2 keeps its "
                        "stage gathered")  # fmt: skip
    p.add_argument("--json", help="write every figure here")
    args = p.parse_args()
    if args.rounds <= WARMUP:
        p.error(f"--rounds must be > {WARMUP} (the warm-up rounds), got {args.rounds}")
    if args.layers % args.pp:
        p.error(f"--layers {args.layers} must be a multiple of --pp {args.pp}")
    if args.microbatches < args.pp:
        p.error(f"--microbatches {args.microbatches} must be >= --pp {args.pp} (Schedule1F1B)")
    return args


def main() -> None:
    args = parse_args()
    _return_freed_memory()
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if world % args.pp:
        raise SystemExit(f"--pp {args.pp} does not divide the world size {world}")
    mesh = init_device_mesh("cpu", (args.pp, world // args.pp), mesh_dim_names=("pp", "dp"))
    out = {"config": vars(args), "world": world, "dp": world // args.pp}
    out["result"] = run(args, mesh)
    if dist.get_rank() == 0:
        print_report(out)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    end_process_group()


if __name__ == "__main__":
    main()
