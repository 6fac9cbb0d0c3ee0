"""Step time of sharded training with eager vs ``torch.compile``-d block compute, interleaved.

    OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=65536 torchrun --nproc-per-node 2 \\
        bench/bench_compile.py [--steps 12] [--model PRESET] [--backend inductor] \\
        [--modes eager,blocks,local,local_blocks] [--json OUT.json]

Modes (every model from the same seed, trained side by side on the same batches):
  eager         ``fs.shard(model, policy=by_type(Block))``
  blocks        the same, then ``block.forward = torch.compile(block.forward)`` for every block
                (flatshard's hooks stay eager on ``block.__call__``: the supported composition)
  model         the same as eager, then ``torch.compile(model)`` (graph breaks in every hook)
  local         the plain model on the rank's batch, no communication
  local_blocks  the plain model with compiled block forwards (the compute-only gain)
Default model: the anchor GPT of bench_step.py (D=384, L=6, V=8192); ``--model small`` etc. use
the reference GPT. The harness (barrier, slowest rank, rotated order, first rounds discarded) is
:mod:`flatshard.bench`'s; the first step of each mode (which compiles) runs before the rounds and
is reported as ``first_step_s``. See docs/performance.md, "torch.compile".
"""

from __future__ import annotations

import argparse
import json
import shutil
import time

import torch
import torch.distributed as dist
from torch import nn

import flatshard as fs
from flatshard.bench import WARMUP, AnchorBlock, AnchorGPT, Runner, median, run_rounds, train_step
from flatshard.comm.shutdown import end_process_group

MODES = ("eager", "blocks", "model", "local", "local_blocks")
PAIRS = (("blocks", "eager"), ("model", "eager"), ("local_blocks", "local"), ("eager", "local"))


def build_model(args: argparse.Namespace) -> tuple[nn.Module, type[nn.Module]]:
    """The configured model (seeded) and its block class."""
    torch.manual_seed(args.seed)
    if args.model:
        from flatshard.models import GPT, Block, GPTConfig

        return GPT(GPTConfig.preset(args.model, max_seq_len=args.seq)), Block
    return AnchorGPT(args.vocab, args.d, args.layers, args.heads, args.seq), AnchorBlock


def compile_blocks(model: nn.Module, block: type[nn.Module], backend: str) -> int:
    """Compile the forward of every ``block`` instance in place; returns how many."""
    blocks = [m for m in model.modules() if isinstance(m, block)]
    for m in blocks:
        m.forward = torch.compile(m.forward, backend=backend)
    return len(blocks)


def build(mode: str, args: argparse.Namespace) -> Runner:
    model, block = build_model(args)
    if not mode.startswith("local"):
        model = fs.shard(model, policy=fs.wrap.by_type(block))
    if mode.endswith("blocks"):
        compile_blocks(model, block, args.backend)
    if mode == "model":
        model = torch.compile(model, backend=args.backend)
    return Runner(mode, model, torch.optim.AdamW(model.parameters(), lr=1e-3))


def vocab(args: argparse.Namespace) -> int:
    if args.model:
        from flatshard.models import GPTConfig

        return GPTConfig.preset(args.model).vocab_size
    return args.vocab


def summarize(runners: list[Runner], first: dict[str, float], args: argparse.Namespace) -> dict:
    by = {r.name: r for r in runners}
    out: dict = {"config": vars(args), "world": dist.get_world_size(), "modes": {}, "ratios": {}}
    for r in runners:
        ref = by.get("local" if r.name.startswith("local") else "eager")
        diff = max(abs(a - b) for a, b in zip(r.losses, ref.losses, strict=True)) if ref else None
        out["modes"][r.name] = {
            "median_step_s": median(r.times[WARMUP:]),
            "first_step_s": first[r.name],
            "times_s": r.times,
            "losses": r.losses,
            "max_loss_diff_vs_eager": diff,
        }
    for a, b in PAIRS:
        if a in by and b in by:
            ta, tb = by[a].times[WARMUP:], by[b].times[WARMUP:]
            out["ratios"][f"{a}/{b}"] = {
                "of_medians": median(ta) / median(tb),
                "paired_median": median([p / q for p, q in zip(ta, tb, strict=True)]),
            }
    return out


def print_report(out: dict) -> None:
    c = out["config"]
    shape = f"model={c['model']}" if c["model"] else f"d={c['d']} L={c['layers']} V={c['vocab']}"
    print(f"\n== bench_compile  world={out['world']}  {shape}  batch={c['batch']}x{c['seq']}  "
          f"backend={c['backend']}  rounds={c['steps']} (first {WARMUP} discarded)")  # fmt: skip
    print(f"{'mode':<14}{'median s':>10}{'first step s':>14}{'|dloss| vs eager':>18}")
    for name, m in out["modes"].items():
        d = m["max_loss_diff_vs_eager"]
        print(f"{name:<14}{m['median_step_s']:>10.3f}{m['first_step_s']:>14.2f}"
              f"{d if d is not None else float('nan'):>18.2e}")  # fmt: skip
    print(f"\n{'ratio':<22}{'of medians':>11}{'paired median':>15}")
    for k, v in out["ratios"].items():
        print(f"{k:<22}{v['of_medians']:>11.3f}{v['paired_median']:>15.3f}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12, help=f"rounds, incl. {WARMUP} warm-up")
    p.add_argument("--dim", "--d", dest="d", type=int, default=384)
    for name, default in (("layers", 6), ("vocab", 8192), ("heads", 6)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--model", help="reference GPT preset (tiny, small, ...) instead of the anchor")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default=None, help="inductor (default if g++ is found) or other")
    p.add_argument("--modes", default="eager,blocks,local,local_blocks", help=", ".join(MODES))
    p.add_argument("--json", help="write every figure here")
    args = p.parse_args()
    args.modes = [m for m in args.modes.split(",") if m]
    if bad := [m for m in args.modes if m not in MODES]:
        p.error(f"unknown --modes {bad}; choose among {', '.join(MODES)}")
    if args.steps <= WARMUP:
        p.error(f"--steps must be > {WARMUP} (the warm-up rounds), got {args.steps}")
    if args.backend is None:  # inductor on CPU compiles C++: without a compiler say so, go on
        args.backend = "inductor" if shutil.which("g++") or shutil.which("c++") else "aot_eager"
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    runners = [build(m, args) for m in args.modes]
    x = torch.randint(0, vocab(args), (args.batch, args.seq + 1), generator=torch.Generator())
    first: dict[str, float] = {}
    for r in runners:  # compile (and warm up) outside the timed rounds
        t0 = time.perf_counter()
        train_step(r, x)
        first[r.name] = time.perf_counter() - t0
        r.times.clear(), r.losses.clear(), r.comm.clear()
    run_rounds(runners, args, vocab(args))
    out = summarize(runners, first, args)
    if dist.get_rank() == 0:
        print_report(out)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    end_process_group()


if __name__ == "__main__":
    main()
