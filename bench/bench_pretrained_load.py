"""Host memory of loading pretrained safetensors weights into a sharded model, per rank.

Run (CPU, Gloo, ranks spawned here; the default is a 168M-parameter GPT, 673 MB in fp32):
    OMP_NUM_THREADS=1 python bench/bench_pretrained_load.py [--worlds 2 3] \
        [--dim 768 --layers 12 --heads 12 --vocab 54272] [--dir DIR] [--json F]

The weights are written once as one ``model.safetensors`` (untied GPT, flatshard.models).
Then, for each world size, fresh ranks build the model on the meta device and shard it
(``fs.shard``, one unit per block); for each method in turn they reset their peak RSS
(``/proc/self/clear_refs``) and load:
  sliced     ``fs.load(path, model=model)``: every rank reads only its fragments (sliced.py)
  load_file  every rank ``safetensors.torch.load_file``s the whole file (memory-mapped), then
             copies its fragments
  in_memory  every rank reads the whole file and builds every tensor
             (``safetensors.torch.load(bytes)``), then copies its fragments
The figure is each rank's peak resident memory during the load above its resident memory just
before it (VmHWM - VmRSS, which counts file pages mapped in too), max over ranks, beside the
rank's shard and the largest tensor; and the load's wall and CPU time (of the rank's process,
max over ranks: CPU time is the steadier figure on a loaded host). Ranks run with
``MALLOC_MMAP_THRESHOLD_=65536`` so freed blocks go back to the OS. Both methods must load
identical fragments (checked). World 1 runs in this process, without spawning (the smoke
test's quick path).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flatshard as fs
from flatshard.checkpoint.contents import model_layout
from flatshard.comm.shutdown import end_process_group
from flatshard.models import GPT, GPTConfig
from flatshard.models.block import Block

METHODS = ("sliced", "load_file", "in_memory")
MB = 1e6


def config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(
        vocab_size=args.vocab,
        d_model=args.d,
        n_layers=args.layers,
        n_heads=args.heads,
        max_seq_len=64,
        tie_embeddings=False,
    )


def write_weights(args: argparse.Namespace, path: Path) -> dict:
    """Write the model's state dict to ``path`` once; its size and largest tensor."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    sd = GPT(config(args)).state_dict()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return {
        "params": sum(v.numel() for v in sd.values()),
        "file_mb": path.stat().st_size / MB,
        "largest_tensor_mb": max(v.numel() * v.element_size() for v in sd.values()) / MB,
    }


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    """Make VmHWM restart from the current RSS (Linux: write 5 to clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def load_naive(path: Path, model: torch.nn.Module, method: str) -> None:
    """Every rank opens the whole file (``load_file``: memory-mapped, so only the pages it
    copies from become resident; ``in_memory``: the file's bytes read, then every tensor
    built, as with a ``torch.load`` that does not mmap), then copies its fragments."""
    import safetensors.torch as st

    sd = st.load_file(str(path)) if method == "load_file" else st.load(path.read_bytes())
    with torch.no_grad():
        for name, p in model_layout(model).params.items():
            n = p.fragment.numel()
            p.fragment.copy_(sd[name].reshape(-1)[p.start : p.start + n])
    del sd


def measure_load(method: str, path: Path, model: torch.nn.Module) -> dict:
    """Load ``path`` into ``model`` by ``method``; resident memory it added at its peak."""
    dist.barrier()
    _reset_peak()
    before_kb = _status_kb("VmRSS")
    start, cpu = time.perf_counter(), time.process_time()
    if method == "sliced":
        fs.load(path, model=model)
    else:
        load_naive(path, model, method)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak_kb = _status_kb("VmHWM")
    dist.barrier()
    return {
        "rss_before_mb": before_kb * 1024 / MB,
        "peak_above_before_mb": (peak_kb - before_kb) * 1024 / MB,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "checksum": [float(p.detach().double().sum()) for p in model.parameters()],
    }


def rank_main(rank: int, world: int, path: str, port: int, args) -> None:
    """One rank: shard a meta-built model, then load the file by each method in turn."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    with torch.device("meta"):
        model = GPT(config(args))
    model = fs.shard(model, policy=fs.wrap.by_type(Block))
    shard_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / MB
    result = {m: measure_load(m, Path(path), model) for m in METHODS}
    result["shard_mb"] = shard_mb
    result["ru_maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB
    Path(path).with_name(f"result_{world}_{rank}.json").write_text(json.dumps(result))
    end_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, path: Path, args) -> list[dict]:
    """Spawn ``world`` fresh ranks that load ``path`` by each method; their results."""
    port = _free_port()
    if world == 1:  # in this process (a quick smoke run; this process's malloc settings)
        rank_main(0, 1, str(path), port, args)
        return [json.loads(path.with_name("result_1_0.json").read_text())]
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by the spawned ranks' malloc
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.start_processes(
        rank_main, args=(world, str(path), port, args), nprocs=world, start_method="spawn"
    )
    return [
        json.loads(path.with_name(f"result_{world}_{r}.json").read_text()) for r in range(world)
    ]


def summarize(info: dict, results: dict[int, list[dict]]) -> dict:
    rows = []
    for world, ranks in results.items():
        sums = [[r[m]["checksum"] for r in ranks] for m in METHODS]
        assert all(s == sums[0] for s in sums), f"the methods loaded different weights at {world}"
        for method in METHODS:
            row = {"world": world, "method": method}
            row["peak_above_before_mb"] = max(r[method]["peak_above_before_mb"] for r in ranks)
            row["rss_before_mb"] = max(r[method]["rss_before_mb"] for r in ranks)
            row["seconds"] = max(r[method]["seconds"] for r in ranks)
            row["cpu_seconds"] = max(r[method]["cpu_seconds"] for r in ranks)
            row["shard_mb"] = max(r["shard_mb"] for r in ranks)
            rows.append(row)
        rows[-1]["ru_maxrss_mb"] = max(r["ru_maxrss_mb"] for r in ranks)
    return {**info, "rows": rows}


def report(out: dict) -> None:
    print(
        f"pretrained load: {out['params'] / 1e6:.1f}M parameters, file {out['file_mb']:.0f} MB, "
        f"largest tensor {out['largest_tensor_mb']:.0f} MB; per rank, max over ranks"
    )
    print("  world method      added at peak   shard    RSS before   wall      CPU")
    for row in out["rows"]:
        print(
            f"  {row['world']:5} {row['method']:10} {row['peak_above_before_mb']:9.0f} MB"
            f"   {row['shard_mb']:6.0f} MB {row['rss_before_mb']:7.0f} MB {row['seconds']:6.2f} s"
            f" {row['cpu_seconds']:6.2f} s"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    p.add_argument("--dim", dest="d", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=54272)
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="flatshard_pretrained_"))
    root.mkdir(parents=True, exist_ok=True)
    path = root / "model.safetensors"
    try:
        info = write_weights(args, path)
        results = {w: measure(w, path, args) for w in args.worlds}
        out = summarize(info, results)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
