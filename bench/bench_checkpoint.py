"""Checkpoint save/load throughput: flatshard (fs.save/fs.load) vs torch DCP on FSDP2, interleaved.

Run (world 2, gloo, CPU):
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 bench/bench_checkpoint.py \
        [--rounds 4] [--dim 512 --layers 8 --vocab 8192 --heads 8] [--dir DIR] [--json F]

Both models are the same GPT (bench_step.py's), same seed, one AdamW step taken so optimizer
state exists; each checkpoint holds the model and the optimizer state. Every round saves and
then loads with each method (order rotated each round); a time is the slowest rank's, between
barriers, including fsync and (flatshard) checksums and the atomic commit. Throughput is the
checkpoint's bytes on disk over the median time; ratios are ratios of medians. The figure to
read is the ratio; absolute MB/s on this shared box are disk-cache noise. ``flatshard_async``
is the time ``fs.save(async_=True)`` blocks the training loop (the snapshot), ``fsdp2_async``
the time ``dcp.async_save`` does (its staging copy); each write is waited for after it.
``readback`` is fs.save as it was before it hashed while writing (files hashed by reading them
back after DCP wrote them), for a before/after comparison in the same run. The ``writers``
rows then time the DCP writers alone (no model, no commit): DCP's without a hash, with the
files read back to hash them, hashing while writing, and that plus starting each block's
writeback (what fs.save does).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import flatshard as fs
import flatshard.checkpoint as ckpt
from flatshard.checkpoint import digest_writer
from flatshard.checkpoint.digest_writer import DigestWriter
from flatshard.checkpoint.safety import describe_file
from flatshard.comm.shutdown import end_process_group
from flatshard.tools.bench import AnchorBlock as Block
from flatshard.tools.bench import AnchorGPT as GPT


def build(mode: str, args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(args.vocab, args.d, args.layers, args.heads, args.seq)
    if mode == "flatshard":
        model = fs.shard(model, policy=fs.wrap.by_type(Block))
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, args.vocab, (2, args.seq + 1), generator=torch.Generator().manual_seed(1))
    F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def fsdp2_save(model, opt, path: Path) -> None:
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(sd, checkpoint_id=str(path))


def fsdp2_async_save(model, opt, path: Path, group, pending: list) -> None:
    """``dcp.async_save`` (torch's thread flavour, over its own Gloo group): the time it
    blocks is the staging copy; the write is waited for before the next operation."""
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    pending.append(dcp.async_save(sd, checkpoint_id=str(path), process_group=group))


def fsdp2_load(model, opt, path: Path) -> None:
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=str(path))
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])


class ReadBackWriter(dcp.FileSystemWriter):
    """fs.save's writer before hashing while writing: DCP's own, then every data file read
    back to hash it (the ``readback`` rows; the same checkpoint otherwise)."""

    def __init__(self, path) -> None:
        super().__init__(str(path), sync_files=True)

    def data_files(self, directory: Path, rank: int) -> dict[str, dict]:
        return {p.name: describe_file(p) for p in sorted(directory.glob(f"__{rank}_*.distcp"))}


def readback_save(model, opt, path: Path) -> None:
    ckpt.saver.DigestWriter = ReadBackWriter  # the writer fs.save builds, for this call only
    try:
        ckpt.save(path, model=model, optimizer=opt)
    finally:
        ckpt.saver.DigestWriter = DigestWriter


def timed(fn, *args) -> tuple[float, float]:
    """Seconds ``fn`` took on the slowest rank, and the most CPU seconds a rank's process (all
    its threads) spent in it: less sensitive than wall time to other jobs on the box."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn(*args)
    c1 = time.process_time()
    dist.barrier()
    t = torch.tensor([time.perf_counter() - t0, c1 - c0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t[0].item(), t[1].item()


def run(args: argparse.Namespace) -> dict:
    root = Path(args.dir)
    models = {m: build(m, args) for m in ("flatshard", "fsdp2")}
    fs_model, fs_opt = models["flatshard"]
    group, pending = dist.new_group(backend="gloo"), []
    ops = {
        "flatshard_save": lambda p: ckpt.save(p, model=fs_model, optimizer=fs_opt),
        "flatshard_load": lambda p: ckpt.load(p, model=fs_model, optimizer=fs_opt),
        "fsdp2_save": lambda p: fsdp2_save(*models["fsdp2"], p),
        "fsdp2_load": lambda p: fsdp2_load(*models["fsdp2"], p),
        "flatshard_async": lambda p: ckpt.save(p, model=fs_model, optimizer=fs_opt, async_=True),
        "fsdp2_async": lambda p: fsdp2_async_save(*models["fsdp2"], p, group, pending),
        "readback_save": lambda p: readback_save(fs_model, fs_opt, p),
        "readback_load": lambda p: ckpt.load(p, model=fs_model, optimizer=fs_opt),
    }
    times: dict[str, list[float]] = {k: [] for k in ops}
    cpu: dict[str, list[float]] = {k: [] for k in ops}
    sizes: dict[str, int] = {}
    for i in range(args.rounds + 1):  # round 0 is warmup
        modes = ["flatshard", "fsdp2", "readback"]
        order = modes[i % 3 :] + modes[: i % 3]
        for mode in order:
            path = root / f"{mode}_{i}"
            for op in ("save", "load"):
                t = timed(ops[f"{mode}_{op}"], path)
                if i > 0:
                    times[f"{mode}_{op}"].append(t[0])
                    cpu[f"{mode}_{op}"].append(t[1])
            sizes[mode] = sum(f.stat().st_size for f in path.iterdir())
            _cleanup(path)
        for key in ("flatshard_async", "fsdp2_async"):
            path = root / f"{key}_{i}"
            t = timed(ops[key], path)
            ckpt.saver.session_of(fs_model).wait_pending()
            while pending:
                pending.pop().result()
            if i > 0:
                times[key].append(t[0])
                cpu[key].append(t[1])
            _cleanup(path)
    return summarize(times, cpu, sizes)


WRITERS = ("dcp_no_hash", "read_back", "while_writing", "while_writing_writeback")


def write_with(writer: str, state: dict, path: Path) -> None:
    """This rank writes ``state`` alone (``no_dist``) through ``writer``, hashing as it says."""
    w = ReadBackWriter(path) if writer in ("dcp_no_hash", "read_back") else DigestWriter(path)
    kick = digest_writer._sync_file_range
    if writer == "while_writing":
        digest_writer._sync_file_range = lambda: None  # no writeback started per block
    try:
        dcp.save(state, storage_writer=w, no_dist=True)
    finally:
        digest_writer._sync_file_range = kick
    if writer != "dcp_no_hash":
        w.data_files(path, 0)


def writer_rounds(args: argparse.Namespace) -> dict:
    """The writers alone: every rank writes ``--writer-mb`` of fp32 tensors (4 MB each) into
    its own directory at the same time; wall time and CPU of the slowest rank."""
    root, rank = Path(args.dir), dist.get_rank()
    numel = min(1 << 20, max(1, args.writer_mb * (1 << 18)))
    state = {f"t{i}": torch.randn(numel) for i in range(max(1, args.writer_mb // 4))}
    times: dict[str, list[float]] = {k: [] for k in WRITERS}
    cpu: dict[str, list[float]] = {k: [] for k in WRITERS}
    for i in range(args.rounds + 1):
        for writer in WRITERS[i % 4 :] + WRITERS[: i % 4]:
            path = root / f"writer_{writer}_{rank}"
            wall, used = timed(write_with, writer, state, path)
            shutil.rmtree(path, ignore_errors=True)
            if i > 0:
                times[writer].append(wall)
                cpu[writer].append(used)
    med = {k: (statistics.median(times[k]), statistics.median(cpu[k])) for k in WRITERS}
    return {"writer_mb": sum(t.nbytes for t in state.values()) / 1e6, "median_wall_cpu_s": med}


def _cleanup(path: Path) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def summarize(times: dict[str, list[float]], cpu: dict, sizes: dict[str, int]) -> dict:
    med = {k: statistics.median(v) for k, v in times.items()}
    mb = {m: s / 1e6 for m, s in sizes.items()}
    out = {"bytes": sizes, "median_s": med, "times_s": times, "cpu_s": cpu}
    out["median_cpu_s"] = {k: statistics.median(v) for k, v in cpu.items()}
    out["mb_per_s"] = {k: mb[k.split("_")[0]] / v for k, v in med.items() if "async" not in k}
    out["ratio_flatshard_over_fsdp2_time"] = {
        op: med[f"flatshard_{op}"] / med[f"fsdp2_{op}"] for op in ("save", "load", "async")
    }
    out["ratio_readback_over_fsdp2_save_time"] = med["readback_save"] / med["fsdp2_save"]
    return out


def report(out: dict, args: argparse.Namespace) -> None:
    print(
        f"checkpoint of GPT d={args.d} layers={args.layers} vocab={args.vocab} + AdamW state, "
        f"world {dist.get_world_size()}, {args.rounds} rounds (+1 warmup), median times"
    )
    for mode, size in out["bytes"].items():
        print(f"  {mode:9} on disk: {size / 1e6:8.1f} MB")
    for key, sec in out["median_s"].items():
        rate = out["mb_per_s"].get(key)
        extra = f"{rate:8.1f} MB/s" if rate else "   (blocking time of the async save)"
        lo, hi = min(out["times_s"][key]) * 1e3, max(out["times_s"][key]) * 1e3
        cpu_ms = out["median_cpu_s"][key] * 1e3
        print(
            f"  {key:16} {sec * 1e3:7.0f} ms [{lo:5.0f} – {hi:5.0f}] cpu {cpu_ms:5.0f} ms {extra}"
        )
    for op, ratio in out["ratio_flatshard_over_fsdp2_time"].items():
        if op == "async":
            print(f"  async: flatshard's blocking time / fsdp2's = {ratio:.2f}x")
        else:
            print(f"  {op}: flatshard MB/s / fsdp2 MB/s = {1 / ratio:.2f}x (time {ratio:.2f}x)")
    ratio = out["ratio_readback_over_fsdp2_save_time"]
    print(f"  save, hashing by reading back: MB/s / fsdp2's = {1 / ratio:.2f}x (time {ratio:.2f}x)")
    writers = out["writers"]
    print(f"  writers alone, {writers['writer_mb']:.0f} MB per rank, every rank at once:")
    for writer, (wall, cpu) in writers["median_wall_cpu_s"].items():
        print(f"    {writer:24} {wall * 1e3:7.0f} ms   cpu {cpu * 1e3:6.0f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--dim", dest="d", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--writer-mb", type=int, default=200, help="per rank, for the writer rows")
    p.add_argument("--dir", default="/tmp/flatshard_ckpt_bench")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = run(args)
    out["writers"] = writer_rounds(args)
    if dist.get_rank() == 0:
        report(out, args)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
    end_process_group()


if __name__ == "__main__":
    main()
