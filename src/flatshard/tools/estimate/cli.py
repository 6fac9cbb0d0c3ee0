"""``flatshard estimate``: command-line options -> specs -> a report (table or JSON)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings

from flatshard.tools.estimate.accumulate import (
    Accumulation,
    accumulated_grad_bytes,
    accumulated_peak,
    accumulation,
    check_grad_accum,
)
from flatshard.tools.estimate.devices import DEVICES, Device
from flatshard.tools.estimate.memory import MemoryEstimate, estimate_memory
from flatshard.tools.estimate.pipeline_report import add_options, format_section, section
from flatshard.tools.estimate.report import GIB, Report, format_table, to_json
from flatshard.tools.estimate.reserved import RUNTIMES, estimate_reserved
from flatshard.tools.estimate.spec import STRATEGIES, Layout, ModelSpec, Precision, Workload
from flatshard.tools.estimate.steptime import estimate_time

__all__ = ["build_parser", "estimate", "main"]

EXAMPLES = """examples:
  flatshard estimate --model small --world 2 --gpu cpu --batch 2 --seq 128 --measure
  flatshard estimate --params 70e9 --layers 80 --hidden 8192 --heads 64 --kv-heads 8 \\
      --vocab 128256 --seq 4096 --world 64 --gpu h100 --act-ckpt
  flatshard estimate --model 1b --world 8 --strategy shard_grad_op --json -
  flatshard estimate --layers 80 --hidden 8192 --heads 64 --kv-heads 8 --ffn 28672 \\
      --vocab 128256 --seq 8192 --batch 16 --world 32 --tp 8 --act-ckpt
      (torchtitan's Llama 3 70B on 256 GPUs: FSDP 32 x TP 8)
  flatshard estimate --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 \
      --vocab 128256 --seq 65536 --world 4 --cp 2 --act-ckpt --compile --float8 --gpu h100-gt
      (torchtitan's Llama 3.1 8B at 64K tokens on 8 GPUs: FSDP 4 x CP 2)
  flatshard estimate --model 1b --world 4 --batch 8 --pp 4 --microbatches 8 --schedule 1F1B
  flatshard estimate --model small --world 8 --experts 8 --top-k 2 --ep 4
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flatshard estimate",
        description="Per-rank memory and step time of a GPT-style model under flatshard.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m = p.add_argument_group("model (a preset, or explicit sizes)")
    m.add_argument("--model", help="reference GPT preset: tiny, small, medium, large, 1b")
    m.add_argument("--params", type=float, help="total parameters, e.g. 70e9 (solves --ffn)")
    for name in ("layers", "hidden", "heads", "kv-heads", "vocab", "ffn"):
        m.add_argument(f"--{name}", type=int)
    m.add_argument("--mlp", choices=("swiglu", "gelu"), default="swiglu")
    m.add_argument("--norm", choices=("rmsnorm", "layernorm"), default="rmsnorm")
    m.add_argument("--tied", action="store_true", help="explicit sizes: tie embedding and head")
    _layout_options(p.add_argument_group("layout and workload"))
    add_options(p.add_argument_group("pipeline and experts"))
    _hardware_options(p.add_argument_group("hardware"))
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="write the JSON report ('-' = stdout only)")
    measure_help = "also measure flatshard on this machine (CPU, Gloo; presets only)"
    out.add_argument("--measure", action="store_true", help=measure_help)
    return p


def _layout_options(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--world", type=int, default=8,
                   help="data-parallel degree: ranks that see different data (default 8); "
                   "with --tp each is a group of tp GPUs, world x tp GPUs in all")  # fmt: skip
    g.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree, torchtitan's Llama plan (default 1); heads, "
                   "kv-heads and ffn must be multiples of it")  # fmt: skip
    g.add_argument("--no-sequence-parallel", action="store_true",
                   help="with --tp: replicate norms and the residual stream (all-reduces) "
                   "instead of torchtitan's sequence parallelism")  # fmt: skip
    g.add_argument("--async-tp", action="store_true",
                   help="with --tp: torchtitan's async TP (hides the TP collectives)")  # fmt: skip
    g.add_argument("--cp", type=int, default=1,
                   help="context-parallel degree (default 1): the sequence split over cp GPUs "
                   "(head-tail balanced, ring attention); world x cp x tp GPUs in all")  # fmt: skip
    g.add_argument("--grad-accum", type=int, default=1, metavar="N",
                   help="micro-batches (each --batch) per optimizer step, accumulated with "
                   'fs.no_sync(keep="unsharded") (default 1)')  # fmt: skip
    g.add_argument("--strategy", choices=STRATEGIES, default="full_shard")
    g.add_argument("--shard-size", type=int, help="hybrid_shard: ranks per shard group")
    batch_help = "sequences per data-parallel rank, shared by its tp GPUs (default 1)"
    g.add_argument("--batch", type=int, default=1, help=batch_help)
    g.add_argument("--seq", type=int, help="tokens per sequence (default: the preset's "
                   "max_seq_len, else 2048)")  # fmt: skip
    g.add_argument("--dtype", choices=("fp32", "bf16"),
                   help="fp32, or bf16 mixed precision with fp32 master weights (default: "
                   "bf16 on GPUs, fp32 on cpu)")  # fmt: skip
    g.add_argument("--reduce-dtype", choices=("fp32", "bf16"), help="default: --dtype")
    g.add_argument("--optimizer", choices=("adamw", "sgdm", "sgd"), default="adamw")
    impl_help = "torch.optim implementation (default: forloop on cpu, else foreach)"
    g.add_argument("--optimizer-impl", choices=("foreach", "forloop", "fused"), help=impl_help)
    g.add_argument("--prefetch-forward", type=int, default=1, help="fs.Prefetch(forward=)")
    g.add_argument("--prefetch-backward", choices=("pre", "post", "none"), default="pre")
    g.add_argument("--no-coalesce", action="store_true", help="fs.shard(coalesce=False)")
    g.add_argument("--no-split-root", action="store_true", help="fs.shard(split_root=False)")
    g.add_argument("--act-ckpt", action="store_true", help="checkpoint every block (full AC)")
    g.add_argument("--selective-ac", action="store_true",
                   help="torchtitan's per-op selective AC: save every second matmul's and "
                   "attention's output, recompute the rest")  # fmt: skip
    g.add_argument("--compile", action="store_true", help="blocks under torch.compile (time)")
    g.add_argument("--float8", action="store_true",
                   help="float8 block linears, torchao tensorwise (time)")  # fmt: skip
    g.add_argument("--attention", choices=("flash", "math"), default="flash")
    fused_help = "RMSNorm kernel that saves input+rstd only (default: yes on GPUs)"
    g.add_argument("--fused-norm", choices=("yes", "no"), help=fused_help)


def _hardware_options(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--gpu", choices=tuple(DEVICES),
                   help="device (default h100; cpu with --measure)")  # fmt: skip
    g.add_argument("--memory-gib", type=float, help="memory per rank (default: the device's)")
    mfu_help = "share of peak the executed FLOPs reach, eager bf16 (default: the device's)"
    g.add_argument("--mfu", type=float, help=mfu_help)
    bw_help = "bus bandwidth within a node in GB/s (gigaBYTES: 400 Gb/s = 50)"
    g.add_argument("--bandwidth-gbps", type=float, help=bw_help)
    g.add_argument("--inter-bandwidth-gbps", type=float, help="across nodes, GB/s per rank")
    g.add_argument("--overlap", type=float, help="share of comm hidden (default 0.9; cpu 0.3)")
    g.add_argument("--backend", choices=("nccl", "gloo"), help="default: gloo on cpu")
    rt_help = ("whose streams the reserved-memory estimate assumes: flatshard's (one pool) or "
               "torchtitan's FSDP2 (side-stream pools; its published figures)")  # fmt: skip
    g.add_argument("--runtime", choices=RUNTIMES, default="flatshard", help=rt_help)


def _spec(args: argparse.Namespace) -> ModelSpec:
    if args.model:
        return ModelSpec.from_preset(args.model)
    missing = [n for n in ("layers", "hidden", "heads", "vocab") if getattr(args, n) is None]
    if missing:
        raise ValueError(
            "give --model PRESET, or explicit sizes: missing "
            + ", ".join(f"--{n}" for n in missing)
        )
    return ModelSpec.from_sizes(
        layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab,
        kv_heads=args.kv_heads, ffn=args.ffn, params=args.params, tied=args.tied,
        mlp=args.mlp, norm=args.norm, max_seq=args.seq or 2048,
    )  # fmt: skip


def _inputs(args: argparse.Namespace) -> tuple[ModelSpec, Layout, Workload]:
    spec = _spec(args)
    cpu = args.gpu == "cpu"
    layout = Layout(
        world=args.world,
        strategy=args.strategy,
        shard_size=args.shard_size,
        precision=Precision(args.dtype or ("fp32" if cpu else "bf16"), args.reduce_dtype),
        optimizer=args.optimizer,
        optimizer_impl=args.optimizer_impl or ("forloop" if cpu else "foreach"),
        prefetch_forward=args.prefetch_forward,
        prefetch_backward=args.prefetch_backward,
        backend=args.backend or ("gloo" if cpu else "nccl"),
        coalesce=not args.no_coalesce,
        split_root=not args.no_split_root,
        tp=args.tp,
        sequence_parallel=not args.no_sequence_parallel,
        async_tp=args.async_tp,
        cp=args.cp,
    )
    if args.no_sequence_parallel and args.tp == 1:
        warnings.warn("--no-sequence-parallel has no effect without --tp", stacklevel=2)
    fused = args.fused_norm == "yes" if args.fused_norm else not cpu
    work = Workload(args.batch, args.seq or spec.max_seq, args.act_ckpt, args.attention, fused,
                    args.selective_ac, args.compile, args.float8)  # fmt: skip
    return spec, layout, work


def min_world(
    spec: ModelSpec, layout: Layout, work: Workload, capacity: float, accumulate: bool = False
) -> int | None:
    """Smallest power-of-two data-parallel world (up to 65536; ``layout.tp`` kept) whose peak
    fits in ``capacity`` bytes (with ``accumulate``, beside the flat gradients that
    ``--grad-accum`` keeps: ``accumulate.py``)."""
    for k in range(17):
        lay = dataclasses.replace(layout, world=2**k, shard_size=None)
        mem = estimate_memory(spec, lay, work)
        held = accumulated_grad_bytes(spec, lay, work) if accumulate else 0
        if accumulated_peak(mem, held) <= capacity:
            return 2**k
    return None


def estimate(args: argparse.Namespace) -> Report:
    """Compute the report for parsed command-line ``args``."""
    spec, layout, work = _inputs(args)
    device = DEVICES[args.gpu]
    if args.memory_gib is not None or args.mfu is not None:
        device = dataclasses.replace(
            device, memory_gib=args.memory_gib or device.memory_gib, mfu=args.mfu or device.mfu
        )
    memory = estimate_memory(spec, layout, work)
    links = {"intra_gbps": args.bandwidth_gbps, "inter_gbps": args.inter_bandwidth_gbps,
             "overlap": args.overlap}  # fmt: skip
    time = estimate_time(spec, layout, work, device, **links)
    accum = _accumulation(args, spec, layout, work, device, memory, links)
    cap = device.memory_gib * GIB if device.memory_gib else None
    mins = {}
    if cap is not None:
        for s in ("full_shard", "shard_grad_op", "no_shard"):
            lay = dataclasses.replace(layout, strategy=s)
            mins[s] = min_world(spec, lay, work, cap, accum is not None)
    fits = None if cap is None else (accum.peak if accum else memory.peak) <= cap
    # No CUDA caching allocator on the CPU: the reserved estimate is for GPUs only.
    reserved = None
    if device.name != "cpu":
        reserved = estimate_reserved(spec, layout, work, memory, args.runtime)
    return Report(spec, layout, work, device, memory, time, fits, mins, reserved=reserved,
                  accumulation=accum)  # fmt: skip


def _accumulation(
    args: argparse.Namespace,
    spec: ModelSpec,
    layout: Layout,
    work: Workload,
    device: Device,
    memory: MemoryEstimate,
    links: dict[str, float | None],
) -> Accumulation | None:
    """``--grad-accum N``'s figures (``accumulate.py``), or ``None`` for 1."""
    if check_grad_accum(args.grad_accum) == 1:
        return None
    if getattr(args, "pp", 1) > 1:
        raise ValueError(f"--grad-accum {args.grad_accum} with --pp {args.pp}: under a "
                         "pipeline the schedule's --microbatches are the accumulation; drop "
                         "--grad-accum")  # fmt: skip
    return accumulation(spec, layout, work, device, memory, args.grad_accum, **links)


def _measure(args: argparse.Namespace, report: Report) -> dict[str, int]:
    if not args.model or args.gpu != "cpu":
        raise ValueError("--measure needs --model PRESET and --gpu cpu (it runs flatshard on "
                         "this machine's CPU with Gloo)")  # fmt: skip
    if report.layout.cp > 1 or report.work.selective_ac:
        raise ValueError("--measure does not support --cp or --selective-ac (data-parallel "
                         "flatshard with full or no checkpointing only)")  # fmt: skip
    if report.layout.tp > 1:
        raise ValueError(f"--measure does not support --tp {report.layout.tp}: it measures "
                         "data-parallel flatshard only; drop --tp")  # fmt: skip
    if report.layout.strategy not in ("full_shard", "shard_grad_op", "no_shard"):
        raise ValueError(f"--measure does not support --strategy {report.layout.strategy}")
    from flatshard.tools.estimate.measure import spawn_measure

    lay, work = report.layout, report.work
    return spawn_measure(lay.world, model_name=args.model, batch=work.batch, seq=work.seq,
                         strategy=lay.strategy, act_ckpt=work.act_ckpt,
                         prefetch=(lay.prefetch_forward, lay.prefetch_backward),
                         precision=lay.precision.name, reduce=lay.precision.reduce,
                         coalesce=lay.coalesce, split_root=lay.split_root)[0]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``flatshard estimate``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.gpu = args.gpu or ("cpu" if args.measure else "h100")
    try:
        report = estimate(args)
        if args.measure:
            report = dataclasses.replace(report, measured=_measure(args, report))
        parallel = section(args, report)  # --pp, --experts: None without them
    except ValueError as err:
        parser.error(str(err))
    if args.json != "-":
        print(format_table(report))
        if parallel:
            print(format_section(parallel))
    if args.json:
        data = to_json(report) | ({"pipeline_and_experts": parallel} if parallel else {})
        text = json.dumps(data, indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    sys.stdout.flush()
    return 0
