"""``flatshard bench``: flatshard vs torch FSDP2 vs DDP vs an unsharded step, interleaved.

Launches ``--nproc`` local ranks with ``torch.distributed.run`` (Gloo, one thread per rank);
each round runs one AdamW step of every mode on the same batch (same seed for every model),
order rotated, after a barrier; a step takes its slowest rank's time; 2 warm-up rounds are
dropped. Reports medians and ratios (of medians, and medians of per-round ratios);
``--memory`` adds each mode's peak RSS from one short launch per mode. Method and results:
docs/performance.md; options: docs/estimate.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import flatshard as fs
from flatshard.comm.shutdown import end_process_group

MODES = ("flatshard", "fsdp2", "ddp", "local")
PRECISIONS = ("fp32", "bf16")
WARMUP = 2
RATIOS = (("flatshard", "fsdp2"), ("flatshard", "local"), ("ddp", "local"), ("fsdp2", "local"))


def median(xs: list[float]) -> float:
    """Median, ``nan`` for an empty list."""
    return statistics.median(xs) if xs else float("nan")


def ratio_table(times: dict[str, list[float]], warmup: int = WARMUP) -> dict[str, dict]:
    """For each pair of :data:`RATIOS` present in ``times`` (per-round step seconds by mode):
    the ratio of the medians and the median of per-round ratios, warm-up rounds dropped."""
    out: dict[str, dict] = {}
    for a, b in RATIOS:
        if a in times and b in times:
            ta, tb = times[a][warmup:], times[b][warmup:]
            out[f"{a}/{b}"] = {
                "of_medians": median(ta) / median(tb),
                "paired_median": median([p / q for p, q in zip(ta, tb, strict=True)]),
            }
    return out


class AnchorBlock(nn.Module):
    """Pre-LN block of the anchor GPT (DESIGN.md's and docs/performance.md's figures)."""

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


class AnchorGPT(nn.Module):
    """Token + learned position embeddings, L anchor blocks, final LayerNorm, untied head."""

    def __init__(self, V: int, d: int, L: int, h: int, T: int) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(V, d), nn.Embedding(T, d)
        self.blocks = nn.ModuleList(AnchorBlock(d, h) for _ in range(L))
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
    autocast: bool = False
    """Run forward under bf16 autocast (ddp and local in ``--precision bf16``)."""
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    comm: list[dict] = field(default_factory=list)


def _build_model(args: argparse.Namespace) -> tuple[nn.Module, type[nn.Module]]:
    """The configured model (seeded) and its block class, the unit of every sharded mode."""
    torch.manual_seed(args.seed)
    if args.model:
        from flatshard.models import GPT, Block, GPTConfig

        return GPT(GPTConfig.preset(args.model, max_seq_len=args.seq)), Block
    return AnchorGPT(args.vocab, args.d, args.layers, args.heads, args.seq), AnchorBlock


def _vocab(args: argparse.Namespace) -> int:
    if args.model:
        from flatshard.models import GPTConfig

        return GPTConfig.preset(args.model).vocab_size
    return args.vocab


def build(mode: str, args: argparse.Namespace) -> Runner:
    """Build ``mode``'s model (same seed for every mode) and its AdamW. ``--precision bf16``:
    every mode computes in bf16, reduces gradients in fp32 and keeps fp32 parameters and AdamW
    state (flatshard ``MixedPrecision``, FSDP2 ``MixedPrecisionPolicy``, DDP and local under
    bf16 autocast)."""
    model, block = _build_model(args)
    bf16 = args.precision == "bf16"
    if mode == "flatshard":
        mp = fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = fs.shard(model, policy=fs.wrap.by_type(block), mixed_precision=mp if bf16 else None)
    elif mode == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kwargs = {"mp_policy": policy} if bf16 else {}
        for m in [m for m in model.modules() if isinstance(m, block)]:
            fully_shard(m, **kwargs)
        fully_shard(model, **kwargs)
    elif mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    autocast = bf16 and mode in ("ddp", "local")
    return Runner(mode, model, torch.optim.AdamW(model.parameters(), lr=1e-3), autocast)


def train_step(r: Runner, x: torch.Tensor) -> float:
    """One forward/backward/AdamW step after a barrier; the seconds it took on this rank."""
    if fs.is_sharded(r.model):
        fs.comm_stats(r.model, reset=True)
    dist.barrier()
    t0 = time.perf_counter()
    with _autocast(r, x.device):
        logits = r.model(x[:, :-1])  # [B, T, V]
    loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
    loss.backward()
    r.opt.step()
    r.opt.zero_grad(set_to_none=True)
    dt = time.perf_counter() - t0
    r.losses.append(loss.item())
    if fs.is_sharded(r.model):
        counts = fs.comm_stats(r.model)
        r.comm.append({"calls": counts.calls, "bytes": counts.bytes})
    return dt


def _autocast(r: Runner, device: torch.device) -> contextlib.AbstractContextManager:
    if r.autocast:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def run_rounds(runners: list[Runner], args: argparse.Namespace, vocab: int) -> None:
    """``args.steps`` rounds of one step per mode (rotated order); keep the slowest rank's time."""
    g = torch.Generator().manual_seed(1000 + dist.get_rank())  # world: a tool
    for i in range(args.steps):
        x = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g)
        k = i % len(runners)
        for r in runners[k:] + runners[:k]:  # rotate: no position bias
            r.times.append(train_step(r, x))
    for r in runners:
        t = torch.tensor(r.times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        r.times = t.tolist()


def summarize(runners: list[Runner], args: argparse.Namespace, world: int) -> dict:
    """Medians, throughput, loss agreement with DDP, ratios and flatshard's comm accounting."""
    by = {r.name: r for r in runners}
    out: dict = {"config": vars(args), "world": world, "modes": {}}
    for r in runners:
        med = median(r.times[WARMUP:])
        m = {"median_step_s": med, "tokens_per_s_rank": args.batch * args.seq / med,
             "times_s": r.times, "losses": r.losses}  # fmt: skip
        if "ddp" in by:  # same init, same data: flatshard and fsdp2 must track DDP's loss
            m["max_loss_diff_vs_ddp"] = max(
                abs(a - b) for a, b in zip(r.losses, by["ddp"].losses, strict=True)
            )
        out["modes"][r.name] = m
    out["ratios"] = ratio_table({r.name: r.times for r in runners})
    if "flatshard" in by and by["flatshard"].comm:
        last = by["flatshard"].comm[-1]
        steady = all(c == last for c in by["flatshard"].comm[WARMUP:])
        out["flatshard_comm"] = {**last, "steady": steady}
    if "flatshard" in by:
        out["flatshard_memory"] = flatshard_memory(by["flatshard"])
    return out


def flatshard_memory(r: Runner) -> dict[str, int]:
    """flatshard's own accounting on this rank: bytes of parameter shards, of optimizer state,
    and of gathered parameters (peak over the run, and now: pooled buffers kept between steps)."""
    memory = fs.memory_stats(r.model)
    opt = [t for s in r.opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {
        "shard_bytes": memory.shard_bytes,
        "optimizer_bytes": sum(t.untyped_storage().nbytes() for t in opt),
        "gathered_peak_bytes": memory.gathered_peak_bytes,
        "gathered_now_bytes": memory.gathered_bytes,
    }


def print_report(out: dict) -> None:
    """The table: per mode median/min/max step, tokens/s, loss agreement, peak RSS; ratios."""
    c, rss = out["config"], _rss(out)
    shape = f"model={c['model']}" if c["model"] else f"d={c['d']} L={c['layers']} V={c['vocab']}"
    precision = c.get("precision", "fp32")
    print(f"\n== flatshard bench  world={out['world']}  {shape}  batch={c['batch']}x{c['seq']}"
          f"  precision={precision}  rounds={c['steps']} (first {WARMUP} discarded)")  # fmt: skip
    cols, rss_col = ("mode", "median s", "tok/s/rank", "min s", "max s", "|dloss| vs ddp"), "RSS MB"
    print("{:<10}{:>10}{:>11}{:>8}{:>8}{:>15}".format(*cols) + (f"{rss_col:>12}" if rss else ""))
    for name, m in out["modes"].items():
        ts, d = m["times_s"][WARMUP:], m.get("max_loss_diff_vs_ddp", float("nan"))
        row = f"{name:<10}{m['median_step_s']:>10.3f}{m['tokens_per_s_rank']:>11.0f}"
        row += f"{min(ts):>8.3f}{max(ts):>8.3f}{d:>15.2e}"
        print(row + (f"{rss[name]:>12.0f}" if rss else ""))
    if out["ratios"]:
        print(f"\n{'ratio':<18}{'of medians':>11}{'paired median':>15}")
    for k, v in out["ratios"].items():
        print(f"{k:<18}{v['of_medians']:>11.3f}{v['paired_median']:>15.3f}")
    if "flatshard_comm" in out:
        fc = out["flatshard_comm"]
        ops = [f"{op} {n}x {fc['bytes'][op] / 2**20:.2f} MiB" for op, n in fc["calls"].items()]
        print(f"\nflatshard comm per step (rank 0, steady={fc['steady']}): " + ", ".join(ops))
    if "flatshard_memory" in out:
        mib = {k: v / 2**20 for k, v in out["flatshard_memory"].items()}
        print(f"flatshard memory (rank 0, MiB): parameter shards {mib['shard_bytes']:.1f}, "
              f"optimizer state {mib['optimizer_bytes']:.1f}, gathered peak "
              f"{mib['gathered_peak_bytes']:.1f} (kept between steps "
              f"{mib['gathered_now_bytes']:.1f})")  # fmt: skip
    if rss:
        base = max(out["rss_before_models_mb"])
        print(f"peak RSS: max over ranks, one launch per mode; {base:.0f} MB before any model")


def _rss(out: dict) -> dict[str, float]:
    """Peak RSS (max over ranks) by mode: one-mode launches, or this run if it had one mode."""
    if "peak_rss_mb" in out:
        return {mode: max(v) for mode, v in out["peak_rss_mb"].items()}
    if len(out["modes"]) == 1:
        return {mode: max(out["rss_mb_ranks"]) for mode in out["modes"]}
    return {}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="flatshard bench", description=__doc__.split("\n")[0][21:])
    p.add_argument("--nproc", type=int, default=2, help="local ranks (default 2)")
    p.add_argument("--steps", type=int, default=12, help=f"rounds, incl. {WARMUP} warm-up")
    # torchrun prefix-matches options even after the script: `--d` is ambiguous, use --dim.
    p.add_argument("--dim", "--d", dest="d", type=int, default=384, help="model width")
    for name, default in (("layers", 6), ("vocab", 8192), ("heads", 6)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--model", help="use the reference GPT preset (tiny, small, ...) instead")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    bf16_help = "bf16: every mode computes in bf16, reduces in fp32, keeps fp32 master weights"
    p.add_argument("--precision", choices=PRECISIONS, default="fp32", help=bf16_help)
    p.add_argument("--mode", choices=("all", *MODES), default="all")
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--memory", action="store_true", help="+ peak RSS per mode (extra launches)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps <= WARMUP:
        p.error(f"--steps must be > {WARMUP} (the warm-up rounds), got {args.steps}")
    return args


def run_bench(args: argparse.Namespace) -> dict:
    """The rounds on this (initialised) process group: :func:`summarize`'s figures + RSS."""
    before = _gather_rss()
    modes = MODES if args.mode == "all" else (args.mode,)
    runners = [build(m, args) for m in modes]
    run_rounds(runners, args, _vocab(args))
    out = summarize(runners, args, dist.get_world_size())  # world: a tool
    out["rss_mb_ranks"], out["rss_before_models_mb"] = _gather_rss(), before
    return out


def worker(args: argparse.Namespace) -> None:
    """One rank under torchrun: run the rounds; rank 0 prints and writes the JSON."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = run_bench(args)
    if dist.get_rank() == 0:  # world: a tool
        if not args.quiet:
            print_report(out)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    end_process_group()


def _gather_rss() -> list[float]:
    """Peak RSS (MB) of every rank so far."""
    rss = torch.zeros(dist.get_world_size(), dtype=torch.float64)  # world: a tool
    rank = dist.get_rank()  # world: a tool
    rss[rank] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    dist.all_reduce(rss)
    return rss.tolist()


def _launch(args: argparse.Namespace, mode: str, steps: int, json_path: str) -> None:
    """Run the worker on ``args.nproc`` local ranks with torchrun (one thread each)."""
    fwd = ["--worker", "--quiet", "--steps", str(steps), "--mode", mode, "--json", json_path]
    fwd += ["--precision", args.precision]
    for name in ("d", "layers", "vocab", "heads", "batch", "seq", "seed"):
        fwd += ["--dim" if name == "d" else f"--{name}", str(getattr(args, name))]
    if args.model:
        fwd += ["--model", args.model]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # return freed memory: honest RSS
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd = [*run, "--nproc-per-node", str(args.nproc), "-m", "flatshard.tools.bench", *fwd]
    subprocess.run(cmd, env=env, check=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``flatshard bench`` (and of its workers, with the internal --worker)."""
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "all.json")
        _launch(args, args.mode, args.steps, path)
        with open(path) as f:
            out = json.load(f)
        if args.memory:  # one short launch per mode: each mode's own peak
            out["peak_rss_mb"] = {}
            for mode in out["modes"]:
                one = os.path.join(tmp, f"{mode}.json")
                _launch(args, mode, WARMUP + 3, one)
                with open(one) as f:
                    out["peak_rss_mb"][mode] = json.load(f)["rss_mb_ranks"]
        print_report(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
