"""Step time of compiled flatshard vs eager flatshard vs compiled FSDP2, interleaved.

    OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=65536 torchrun --nproc-per-node 2 \\
        bench/bench_compile.py [--steps 12] [--model PRESET] [--backend inductor] \\
        [--modes eager,blocks,fsdp2_blocks] [--json OUT.json] [--quick]

Modes (every model from the same seed, trained side by side on the same batches):
  eager         flatshard: ``fs.shard(model, policy=by_type(Block))``
  blocks        flatshard, torchtitan's order: ``block.compile(fullgraph=True)`` on every block,
                then ``fs.shard`` (zero graph breaks: the hooks are never traced)
  model         flatshard, then ``torch.compile(model)`` (graph breaks at the unit boundaries)
  fsdp2         torch's FSDP2: ``fully_shard`` on every block, then on the root
  fsdp2_blocks  FSDP2, torchtitan's order: ``block.compile(fullgraph=True)``, then ``fully_shard``
  local         the plain model on the rank's batch, no communication
  local_blocks  the plain model with compiled blocks (the compute-only gain)
Default model: the anchor GPT of bench_step.py (D=384, L=6, V=8192); ``--model small`` etc. use
the reference GPT. The harness (barrier, slowest rank, rotated order, first rounds discarded) is
:mod:`flatshard.tools.bench`'s; the first step of each mode (which compiles) runs before the
rounds and is reported as ``first_step_s``, with the graph breaks and graphs Dynamo reported
during it.
``--quick``: a tiny model, 4 rounds, ``aot_eager`` (the smoke test). See docs/compile.md.
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
from flatshard.comm.shutdown import end_process_group
from flatshard.tools.bench import (
    WARMUP,
    AnchorBlock,
    AnchorGPT,
    Runner,
    median,
    run_rounds,
    train_step,
)

MODES = ("eager", "blocks", "model", "fsdp2", "fsdp2_blocks", "local", "local_blocks")
PAIRS = (
    ("blocks", "eager"),
    ("blocks", "fsdp2_blocks"),
    ("model", "eager"),
    ("eager", "fsdp2"),
    ("fsdp2_blocks", "fsdp2"),
    ("local_blocks", "local"),
)
QUICK = {"d": 32, "layers": 2, "heads": 2, "vocab": 64, "batch": 1, "seq": 16, "steps": 4}


def build_model(args: argparse.Namespace) -> tuple[nn.Module, type[nn.Module]]:
    """The configured model (seeded) and its block class."""
    torch.manual_seed(args.seed)
    if args.model:
        from flatshard.models import GPT, Block, GPTConfig

        return GPT(GPTConfig.preset(args.model, max_seq_len=args.seq)), Block
    return AnchorGPT(args.vocab, args.d, args.layers, args.heads, args.seq), AnchorBlock


def compile_blocks(model: nn.Module, block: type[nn.Module], backend: str) -> int:
    """``block.compile(fullgraph=True)`` on every ``block`` instance, in place (names stay);
    returns how many."""
    blocks = [m for m in model.modules() if isinstance(m, block)]
    for m in blocks:
        m.compile(fullgraph=True, backend=backend)
    return len(blocks)


def build(mode: str, args: argparse.Namespace) -> Runner:
    model, block = build_model(args)
    if mode.endswith("blocks"):  # before sharding: torchtitan's order
        compile_blocks(model, block, args.backend)
    if mode in ("eager", "blocks", "model"):
        model = fs.shard(model, policy=fs.wrap.by_type(block))
    elif mode.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        for m in [m for m in model.modules() if isinstance(m, block)]:
            fully_shard(m)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if mode == "model":
        model = torch.compile(model, backend=args.backend)
    return Runner(mode, model, opt)


def vocab(args: argparse.Namespace) -> int:
    if args.model:
        from flatshard.models import GPTConfig

        return GPTConfig.preset(args.model).vocab_size
    return args.vocab


def first_steps(runners: list[Runner], x: torch.Tensor) -> dict[str, dict]:
    """Each mode's first step (it compiles), outside the timed rounds: its seconds, and the
    graph breaks and graphs Dynamo reported meanwhile."""
    from torch._dynamo.utils import counters

    first: dict[str, dict] = {}
    for r in runners:
        breaks0 = sum(counters["graph_break"].values())
        graphs0 = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        train_step(r, x)
        first[r.name] = {
            "first_step_s": time.perf_counter() - t0,
            "graph_breaks": sum(counters["graph_break"].values()) - breaks0,
            "graphs": counters["stats"]["unique_graphs"] - graphs0,
        }
        r.times.clear(), r.losses.clear(), r.comm.clear()
    return first


def summarize(runners: list[Runner], first: dict[str, dict], args: argparse.Namespace) -> dict:
    by = {r.name: r for r in runners}
    out: dict = {"config": vars(args), "world": dist.get_world_size(), "modes": {}, "ratios": {}}
    for r in runners:
        ref = by.get("local" if r.name.startswith("local") else "eager")
        diff = max(abs(a - b) for a, b in zip(r.losses, ref.losses, strict=True)) if ref else None
        out["modes"][r.name] = {
            "median_step_s": median(r.times[WARMUP:]),
            **first[r.name],
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
    print(f"{'mode':<14}{'median s':>10}{'first step s':>14}{'breaks':>8}{'graphs':>8}"
          f"{'|dloss| vs eager':>18}")  # fmt: skip
    for name, m in out["modes"].items():
        d = m["max_loss_diff_vs_eager"]
        print(f"{name:<14}{m['median_step_s']:>10.3f}{m['first_step_s']:>14.2f}"
              f"{m['graph_breaks']:>8}{m['graphs']:>8}"
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
    p.add_argument("--modes", default="eager,blocks,fsdp2_blocks", help=", ".join(MODES))
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--quick", action="store_true", help="tiny model, 4 rounds, aot_eager")
    args = p.parse_args()
    if args.quick:
        vars(args).update(QUICK, backend=args.backend or "aot_eager")
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
    first = first_steps(runners, x)
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
