"""Optimizer-step time and communication of fs.optim.Muon: against torch's Muon unsharded (world 1)
and against the naive sharded Muon (every rank gathers every whole matrix and orthogonalises it).

Run (world 2, gloo, CPU):
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 bench/bench_muon.py \
        [--rounds 5] [--dim 384 --layers 6 --heads 6 --vocab 8192] [--json F]

The anchor GPT (bench_step.py's), Muon on the blocks' matrices (``fs.optim.muon_split``). One
backward makes the gradients; then every round times one optimizer step of each mode, the
order rotated each round: ``flatshard`` (fs.optim.Muon: one owner per matrix), ``naive`` (the
same momentum, then an all-gather of every matrix to every rank, Newton–Schulz everywhere) and
``torch`` (torch.optim.Muon on an unsharded copy, on rank 0 only: world 1). A time is the
slowest rank's, between barriers; ratios are ratios of medians. Bytes: what each step sends to
other ranks, summed over ranks (bf16), from the plans.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flatshard as fs
from flatshard.comm.shutdown import end_process_group
from flatshard.optim.newton_schulz import orthogonalize
from flatshard.optim.whole import assign_owners, rounds_of
from flatshard.tools.bench import AnchorBlock, AnchorGPT


class NaiveMuon(fs.optim.Muon):
    """fs.optim.Muon's math, the naive way: every rank gathers and orthogonalises every matrix."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                job = self._job(p, group)
                w = job.whole
                piece, most = job.momentum_update().to(torch.bfloat16), max(w.splits)
                send = torch.zeros(most, dtype=torch.bfloat16)
                send[: piece.numel()] = piece
                out = torch.empty(most * len(w.splits), dtype=torch.bfloat16)
                dist.all_gather_into_tensor(out, send, group=w.group)
                full = torch.cat([out[r * most : r * most + n] for r, n in enumerate(w.splits)])
                h = job.hyper
                o = orthogonalize(full.view(w.shape), h["ns_coefficients"], h["ns_steps"], h["eps"])
                job.apply(o.reshape(-1)[w.start : w.end])


def bytes_per_step(opt: fs.optim.Muon, world: int) -> dict[str, int]:
    """Bytes sent to other ranks per step, over all ranks: the owner plan vs all-gathers."""
    jobs = [opt._job(p, g) for g in opt.param_groups for p in g["params"]]
    wholes = [job.whole for job in jobs]
    owned = assign_owners([job.cost for job in jobs], world)  # the plan fs.optim.Muon runs
    owner = {j: r for r, jobs in enumerate(owned) for j in jobs}
    sharded = sum(2 * (w.numel - w.splits[owner[j]]) for j, w in enumerate(wholes))
    naive = sum(w.numel * (world - 1) for w in wholes)
    return {"flatshard": 2 * sharded, "naive": 2 * naive, "rounds": len(rounds_of(owned))}


def loss_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())


def setup(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    plain = AnchorGPT(args.vocab, args.dim, args.layers, args.heads, args.seq)
    sharded = fs.shard(copy.deepcopy(plain), policy=fs.wrap.by_type(AnchorBlock))
    x = torch.randint(0, args.vocab, (2, args.seq + 1), generator=torch.Generator().manual_seed(1))
    loss_of(sharded, x).backward()  # the values do not matter, only the shapes
    opts = {
        "flatshard": fs.optim.Muon(fs.optim.muon_split(sharded)[0], lr=0.02),
        "naive": NaiveMuon(fs.optim.muon_split(sharded)[0], lr=0.02),
    }
    if dist.get_rank() == 0:
        loss_of(plain, x).backward()
        opts["torch"] = torch.optim.Muon(fs.optim.muon_split(plain)[0], lr=0.02)
    return opts


def timed(mode: str, opts: dict) -> float:
    dist.barrier()
    start = time.perf_counter()
    if mode in opts:
        opts[mode].step()
    t = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    opts = setup(args)
    modes = ["flatshard", "naive", "torch"]
    times: dict[str, list[float]] = {m: [] for m in modes}
    for k in range(args.rounds + 1):  # round 0 warms up
        for mode in modes[k % 3 :] + modes[: k % 3]:
            t = timed(mode, opts)
            if k:
                times[mode].append(t)
    med = {m: statistics.median(ts) for m, ts in times.items()}
    world = dist.get_world_size()
    report = {
        "world": world,
        "median_s": med,
        "flatshard/torch": med["flatshard"] / med["torch"],
        "flatshard/naive": med["flatshard"] / med["naive"],
        "bytes_per_step": bytes_per_step(opts["flatshard"], world),
    }
    if dist.get_rank() == 0:
        print(json.dumps(report, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    dist.barrier()  # every rank done communicating before any tears its group down
    end_process_group()


if __name__ == "__main__":
    main()
