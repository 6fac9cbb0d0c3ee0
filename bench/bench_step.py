"""Step time of flatshard vs torch FSDP2 vs DDP vs an unsharded local step, interleaved.

Run (world 2, gloo, CPU):
    OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=65536 torchrun --nproc-per-node 2 \
        bench/bench_step.py [--steps 12] [--d 384 --layers 6 --vocab 8192 --heads 6] \
        [--batch 4 --seq 256] [--json OUT.json] [--mode all|flatshard|fsdp2|ddp|local]

All four models are built from the same seed with the anchor's GPT (shared/bench/anchor_torch.py).
Each round runs one training step of every mode (order rotated each round) after a barrier; the
first 2 rounds are warmup. A step's time is the slowest rank's. Ratios are ratios of medians
(plus the median of per-round paired ratios). ``--mode X`` runs only X, for its peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import flatshard as fs

MODES = ("flatshard", "fsdp2", "ddp", "local")
WARMUP = 2
RATIOS = (("flatshard", "fsdp2"), ("flatshard", "local"), ("ddp", "local"), ("fsdp2", "local"))


class Block(nn.Module):
    """Pre-LN transformer block, identical to the anchor's."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape  # x: [B, T, D]
        qkv = self.qkv(self.ln1(x)).view(B, T, 3, self.h, D // self.h)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, h, T, D/h]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """The anchor's GPT: token + learned position embeddings, L blocks, untied head."""

    def __init__(self, V: int, d: int, L: int, h: int, T: int) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(V, d), nn.Embedding(T, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(L))
        self.lnf = nn.LayerNorm(d)
        self.head = nn.Linear(d, V, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1]))  # [B, T, D]
        for b in self.blocks:
            x = b(x)
        return self.head(self.lnf(x))  # [B, T, V]


@dataclass
class Runner:
    """One mode: its model, its optimizer, and what it measured."""

    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    comm: list[dict[str, dict[str, int]]] = field(default_factory=list)


def build(mode: str, args: argparse.Namespace) -> Runner:
    torch.manual_seed(args.seed)
    model: nn.Module = GPT(args.vocab, args.d, args.layers, args.heads, args.seq)
    if mode == "flatshard":
        model = fs.shard(model, policy=fs.wrap.by_type(Block))
    elif mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
    elif mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    return Runner(mode, model, torch.optim.AdamW(model.parameters(), lr=1e-3))


def train_step(r: Runner, x: torch.Tensor) -> float:
    """One forward/backward/AdamW step; returns the seconds it took on this rank."""
    stats = getattr(r.model, "_flatshard_state", None)
    stats = stats.stats if stats is not None else None
    if stats is not None:
        stats.reset()
    dist.barrier()
    t0 = time.perf_counter()
    loss = F.cross_entropy(r.model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    r.opt.step()
    r.opt.zero_grad(set_to_none=True)
    dt = time.perf_counter() - t0
    r.losses.append(loss.item())
    if stats is not None:
        r.comm.append({"calls": dict(stats.calls), "bytes": dict(stats.bytes)})
    return dt


def run_rounds(runners: list[Runner], args: argparse.Namespace) -> None:
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    for i in range(args.steps):
        x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        k = i % len(runners)
        for r in runners[k:] + runners[:k]:  # rotate the order: no position bias
            r.times.append(train_step(r, x))
    for r in runners:  # a step takes as long as its slowest rank
        t = torch.tensor(r.times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        r.times = t.tolist()


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(runners: list[Runner], args: argparse.Namespace) -> dict:
    tokens = args.batch * args.seq
    by = {r.name: r for r in runners}
    out: dict = {"config": vars(args), "world": dist.get_world_size(), "modes": {}, "ratios": {}}
    for r in runners:
        med = median(r.times[WARMUP:])
        out["modes"][r.name] = {
            "median_step_s": med,
            "tokens_per_s_rank": tokens / med,
            "times_s": r.times,
            "losses": r.losses,
        }
        if "ddp" in by:  # same init, same data: flatshard and fsdp2 must track DDP's loss
            d = max(abs(a - b) for a, b in zip(r.losses, by["ddp"].losses, strict=True))
            out["modes"][r.name]["max_loss_diff_vs_ddp"] = d
    for a, b in RATIOS:
        if a in by and b in by:
            ta, tb = by[a].times[WARMUP:], by[b].times[WARMUP:]
            out["ratios"][f"{a}/{b}"] = {
                "of_medians": median(ta) / median(tb),
                "paired_median": median([p / q for p, q in zip(ta, tb, strict=True)]),
            }
    if "flatshard" in by and by["flatshard"].comm:
        out["flatshard_comm"] = comm_summary(by["flatshard"])
    with torch.device("meta"):
        ref = GPT(args.vocab, args.d, args.layers, args.heads, args.seq)
    out["param_bytes"] = sum(p.numel() * p.element_size() for p in ref.parameters())
    return out


def comm_summary(r: Runner) -> dict:
    """flatshard's own per-step accounting (last step; flags any step-to-step change)."""
    last = r.comm[-1]
    steady = all(c == last for c in r.comm[WARMUP:])
    n = sum(last["calls"].values())
    return {"calls": last["calls"], "bytes": last["bytes"], "collectives": n, "steady": steady}


def print_report(out: dict, rss: dict[str, float]) -> None:
    cfg = out["config"]
    print(f"\n== bench_step  world={out['world']}  d={cfg['d']} L={cfg['layers']} V={cfg['vocab']} "
          f"H={cfg['heads']} batch={cfg['batch']}x{cfg['seq']}  rounds={cfg['steps']} "
          f"(first {WARMUP} discarded)")  # fmt: skip
    head = ("mode", "median s", "tok/s/rank", "min s", "max s", "last loss", "|dloss| vs ddp")
    print("{:<10} {:>9} {:>11} {:>8} {:>8} {:>10} {:>14}".format(*head))
    for name, m in out["modes"].items():
        ts = m["times_s"][WARMUP:]
        print(f"{name:<10} {m['median_step_s']:>9.3f} {m['tokens_per_s_rank']:>11.0f} "
              f"{min(ts):>8.3f} {max(ts):>8.3f} {m['losses'][-1]:>10.5f} "
              f"{m.get('max_loss_diff_vs_ddp', float('nan')):>14.2e}")  # fmt: skip
    print(f"\n{'ratio':<18} {'of medians':>10} {'paired median':>14}")
    for k, v in out["ratios"].items():
        print(f"{k:<18} {v['of_medians']:>10.3f} {v['paired_median']:>14.3f}")
    if "flatshard_comm" in out:
        c = out["flatshard_comm"]
        mib = out["param_bytes"] / 2**20
        print(f"\nflatshard comm per step (rank 0, steady={c['steady']}): "
              f"{c['collectives']} collectives; unsharded params {mib:.2f} MiB fp32")  # fmt: skip
        for op, n in sorted(c["calls"].items()):
            print(f"  {op:<16} calls={n:<4} bytes={c['bytes'][op] / 2**20:9.2f} MiB")
    for name, mb in rss.items():
        print(f"peak RSS {name}: " + "  ".join(f"rank{i}={v:.0f} MB" for i, v in enumerate(mb)))
    print("load average (1 min) at start, end: {:.2f}, {:.2f}".format(*out["loadavg_1m"]))


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def gather_floats(x: float) -> list[float]:
    t = torch.zeros(dist.get_world_size(), dtype=torch.float64)
    t[dist.get_rank()] = x
    dist.all_reduce(t)
    return t.tolist()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12, help="rounds, incl. 2 warmup")
    # torchrun rejects `--d` as an ambiguous prefix of its own options: pass `--dim`, or put
    # `--` before the script's arguments (torchrun ... bench/bench_step.py -- --d 64).
    p.add_argument("--d", "--dim", dest="d", type=int, default=384, help="model width")
    for name, default in (("layers", 6), ("vocab", 8192), ("heads", 6)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=("all", *MODES), default="all")
    p.add_argument("--json", default=None, help="write all figures here (rank 0)")
    args = p.parse_args(argv)
    if args.steps <= WARMUP:
        p.error(f"--steps must be > {WARMUP} (the warmup rounds), got {args.steps}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    base, load0 = gather_floats(peak_rss_mb()), os.getloadavg()
    modes: tuple[str, ...] = MODES if args.mode == "all" else (args.mode,)
    runners = [build(m, args) for m in modes]
    run_rounds(runners, args)
    out = summarize(runners, args)
    rss = {"before models": base, f"end ({args.mode})": gather_floats(peak_rss_mb())}
    out["peak_rss_mb"], out["loadavg_1m"] = rss, (load0[0], os.getloadavg()[0])
    if dist.get_rank() == 0:
        print_report(out, rss)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
