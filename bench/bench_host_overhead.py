"""Host time per unit that the sharding machinery costs on the device path, vs torch FSDP2.

    OMP_NUM_THREADS=1 python bench/bench_host_overhead.py [--units 8 32 100] [--rounds 30]
        [--dim 32] [--batch 4] [--vocab 0] [--json OUT.json]

What it measures: one process, pretending to be rank 0 of a world of two over a process
group that communicates nothing (``NoCommGroup``: an all-gather copies this rank's shard into
every chunk, a reduce-scatter keeps this rank's chunk, an all-reduce is a no-op, every work is
complete at issue). So a step's time is host time only: the model's compute, which the
unsharded step measures, plus what flatshard's or FSDP2's hooks, views, flat buffers and
collective calls add. Models: a chain of ``N`` tiny blocks (each a unit of both libraries) and
a root with an input projection and an output head (a tail, for flatshard). Per round, every
mode runs one forward + backward (no optimizer: its host time is the same per parameter in
every mode) in rotated order, garbage collection paused; warm-up rounds are dropped.

Reported per ``N``: the median step of each mode, machinery per unit = (median - median of
the unsharded step) / N, and flatshard's machinery over FSDP2's (the ratio of those). Three
flatshard rows: its defaults (tiny blocks coalesce into buckets), ``coalesce=False`` (one unit
per block, as FSDP2 has), that with ``split_root=False`` (no root tail, no lazy root) and
that with the root kept gathered from forward into backward (the tail, no lazy root). With
``--vocab 8192`` (the root an embedding of 1 MiB at ``--dim 32``) the root is lazy in the
``coalesce=False`` row, and the last row's difference to it is the lazy root's cost: its
saved-tensor hooks see every tensor the whole forward saves.

The group's name has "gloo" in it so that flatshard uses it for its host-side agreements as it
uses a Gloo group (it makes no second group, which would wait for a rank that does not
exist), and is not "gloo", so flatshard runs its device path (no point-to-point ring, no gather
pool, no clone before an in-place gather) exactly as under NCCL, minus CUDA streams. Results
and their reading: docs/performance.md ("Host overhead per unit").
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

BACKEND = "nocomm_gloo"
WORLD = 2
WARMUP = 3


class _Done(dist.Work):
    """A collective that completed when it was issued."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class NoCommGroup(dist.ProcessGroup):
    """Rank ``rank`` of ``size`` ranks that never talk: outputs are filled from this rank's
    inputs (finite values of the right kind, so the model computes as usual)."""

    def __init__(self, store, rank: int, size: int, timeout) -> None:
        super().__init__(rank, size)

    def getBackendName(self) -> str:
        return BACKEND

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        return self._name

    def _allgather_base(self, output, input, opts=None):
        rows = output.view(self.size(), -1)
        for i in range(self.size()):
            if rows[i].data_ptr() != input.data_ptr():  # in place: this rank's chunk is input
                rows[i].copy_(input.reshape(-1))
        return _Done()

    all_gather_single = _allgather_base

    def _reduce_scatter_base(self, output, input, opts=None):
        output.copy_(input.view(self.size(), -1)[self.rank()].view_as(output))
        return _Done()

    reduce_scatter_single = _reduce_scatter_base

    def allgather(self, output_lists, inputs, opts=None):
        for outs, x in zip(output_lists, inputs, strict=True):
            for out in outs:
                out.copy_(x)
        return _Done()

    def allreduce(self, tensors, opts=None):
        return _Done()

    def broadcast(self, tensors, opts=None):
        return _Done()

    def barrier(self, opts=None):
        return _Done()


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(self.norm(x)))


class Chain(nn.Module):
    """An input projection (the root; an embedding of ``vocab`` tokens when ``vocab``),
    ``units`` blocks, a final norm and head (the tail)."""

    def __init__(self, units: int, d: int, vocab: int = 0) -> None:
        super().__init__()
        self.inp = nn.Embedding(vocab, d) if vocab else nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(units))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(mode: str, units: int, d: int, vocab: int = 0) -> nn.Module:
    """``mode``'s model (same seed for every mode)."""
    import flatshard as fs

    torch.manual_seed(0)
    model = Chain(units, d, vocab)
    if mode == "flatshard":
        return fs.shard(model, policy=fs.wrap.by_type(Block))
    if mode == "flatshard_units":
        return fs.shard(model, policy=fs.wrap.by_type(Block), coalesce=False)
    if mode == "flatshard_unsplit":  # no root tail, no lazy root
        return fs.shard(model, policy=fs.wrap.by_type(Block), coalesce=False, split_root=False)
    if mode == "flatshard_eager_root":  # the tail, but the root kept gathered (never lazy)
        from flatshard.features import root_split

        least, root_split.LAZY_MIN_BYTES = root_split.LAZY_MIN_BYTES, 1 << 62
        try:
            return fs.shard(model, policy=fs.wrap.by_type(Block), coalesce=False)
        finally:
            root_split.LAZY_MIN_BYTES = least
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def step_seconds(model: nn.Module, x: torch.Tensor) -> float:
    """One forward + backward, garbage collection paused; the seconds it took."""
    gc.disable()
    t0 = time.perf_counter()
    model(x).square().mean().backward()
    dt = time.perf_counter() - t0
    gc.enable()
    for p in model.parameters():
        p.grad = None
    return dt


FLATSHARD = ("flatshard", "flatshard_units", "flatshard_unsplit", "flatshard_eager_root")
MODES = ("local", *FLATSHARD, "fsdp2")


def measure(units: int, args: argparse.Namespace) -> dict:
    """Interleaved rounds over every mode for ``units`` blocks: medians and ratios."""
    models = {mode: build(mode, units, args.dim, args.vocab) for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    x = torch.randn(args.batch, args.dim)
    if args.vocab:
        x = torch.randint(0, args.vocab, (args.batch,))
    for i in range(args.rounds):
        k = i % len(MODES)
        for mode in MODES[k:] + MODES[:k]:  # rotate: no position bias
            times[mode].append(step_seconds(models[mode], x))
        gc.collect()
    med = {mode: statistics.median(t[WARMUP:]) for mode, t in times.items()}
    per_unit = {mode: (med[mode] - med["local"]) / units for mode in MODES if mode != "local"}
    return {
        "units": units,
        "median_step_ms": {m: 1e3 * v for m, v in med.items()},
        "machinery_us_per_unit": {m: 1e6 * v for m, v in per_unit.items()},
        "vs_fsdp2": {m: per_unit[m] / per_unit["fsdp2"] for m in FLATSHARD},
    }


def print_table(results: list[dict]) -> None:
    """One row per mode and ``N``: median step, machinery per unit, its ratio to FSDP2's."""
    print(f"{'units':>5} {'mode':<20} {'step ms':>8} {'machinery us/unit':>18} {'vs fsdp2':>9}")
    for r in results:
        for mode in MODES:
            mach = r["machinery_us_per_unit"].get(mode)
            vs = r["vs_fsdp2"].get(mode)
            print(
                f"{r['units']:>5} {mode:<20} {r['median_step_ms'][mode]:>8.2f} "
                f"{'' if mach is None else f'{mach:.1f}':>18} "
                f"{'' if vs is None else f'{vs:.3f}x':>9}"
            )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--units", type=int, nargs="+", default=[8, 32, 100])
    p.add_argument("--rounds", type=int, default=30, help=f"incl. {WARMUP} warm-up rounds")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=0, help="root: an embedding of this many tokens")
    p.add_argument("--json", help="write every figure here")
    args = p.parse_args(argv)
    if args.rounds <= WARMUP:
        p.error(f"--rounds must be > {WARMUP} (the warm-up rounds), got {args.rounds}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, NoCommGroup, devices=["cpu"])
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=0, world_size=WORLD)
    try:
        results = [measure(n, args) for n in args.units]
    finally:
        dist.destroy_process_group()
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
