"""The pipeline / expert section of ``flatshard estimate`` (``--pp``, ``--experts``).

Built on the data-parallel report: with ``--pp P`` a rank holds ``1/P`` of the blocks, so its
step (compute plus data-parallel communication) is the report's over ``P``, stretched by the
bubble; its activations are one microbatch's ``1/P`` stage times the microbatches it holds.
The expert all-to-alls add their time on the ``--ep`` link. See [Note: the estimator's
pipeline and expert parallelism] in ``bubble.py``.
"""

from __future__ import annotations

import argparse
from typing import Any

from flatshard.tools.estimate.bubble import (
    SCHEDULES,
    bubble_fraction,
    expert_traffic,
    held_microbatches,
)
from flatshard.tools.estimate.report import GIB, Report
from flatshard.tools.estimate.stage_memory import PIPE_SCHEDULES, every_rank

__all__ = ["add_options", "format_section", "section"]


def add_options(g: argparse._ArgumentGroup) -> None:
    """``--pp --microbatches --schedule --stages-per-rank --experts --top-k --ep``."""
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (default 1)")
    mb_help = "pipeline microbatches per step (default: --pp); they must divide --batch"
    g.add_argument("--microbatches", type=int, help=mb_help)
    g.add_argument("--schedule", choices=SCHEDULES, default="1F1B", help="pipeline schedule")
    g.add_argument("--stages-per-rank", type=int,
                   help="stages per pp rank (default 1 for GPipe/1F1B, else 2)")  # fmt: skip
    g.add_argument("--experts", type=int, default=0, help="experts per MoE layer (0 = dense)")
    g.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel degree (default 1)")


def _stages_per_rank(args: argparse.Namespace) -> int:
    if args.stages_per_rank is not None:
        return args.stages_per_rank
    return 1 if args.schedule in ("GPipe", "1F1B") else 2


def _pipeline(args: argparse.Namespace, r: Report) -> dict[str, Any]:
    pp, m = args.pp, args.microbatches or args.pp
    v = _stages_per_rank(args)
    if r.spec.layers < pp * v:
        raise ValueError(f"--pp {pp} x {v} stages per rank needs at least {pp * v} layers, "
                         f"the model has {r.spec.layers}")  # fmt: skip
    if r.work.batch % m:
        raise ValueError(f"--microbatches {m} does not divide --batch {r.work.batch} (sequences "
                         f"per data-parallel rank); pass a --batch multiple of {m}")  # fmt: skip
    bubble = bubble_fraction(args.schedule, pp, m, v)
    held = held_microbatches(args.schedule, pp, m, v)
    stage_step = r.time.step_s / pp
    return {
        "pp": pp, "microbatches": m, "schedule": args.schedule, "stages_per_rank": v,
        "bubble": bubble, "held_microbatches": held,
        "stage_activations": r.memory.activations / pp / m * held,
        "stage_model_states": r.memory.model_states / pp,
        "step_s": stage_step / (1 - bubble),
        **_stage_memory(r, args.schedule, pp, m, v),
    }  # fmt: skip


def _stage_memory(r: Report, schedule: str, pp: int, m: int, v: int) -> dict[str, Any]:
    """The stage model's figures (``stage_memory.py``: torch's order, torchtitan's FSDP2
    settings) for pp rank 0 and the rank with the highest peak; none where it does not apply
    (other schedules, no full AC, cp, the CPU)."""
    if (schedule not in PIPE_SCHEDULES or (schedule == "1F1B" and v != 1) or not r.work.act_ckpt
            or r.layout.cp > 1 or r.device.name == "cpu"):  # fmt: skip
        return {}
    ranks = every_rank(r.spec, r.layout, r.work, schedule, pp, m, v)
    top = max(ranks, key=lambda s: s.reserved)
    return {"stage_memory": {f"rank {s.rank}": {
        "stages": list(s.stages), "blocks": list(s.blocks), "peak": s.peak,
        "peak_phase": s.peak_phase, "reserved_est": s.reserved, "reserved_parts": s.reserved_parts,
    } for s in (ranks[0], top)}}  # fmt: skip


def _experts(args: argparse.Namespace, r: Report) -> dict[str, Any]:
    if args.experts % args.ep or args.top_k > args.experts:
        raise ValueError(f"--ep {args.ep} must divide --experts {args.experts}, and --top-k "
                         f"{args.top_k} be at most --experts")  # fmt: skip
    traffic = expert_traffic(
        tokens=r.work.tokens, top_k=args.top_k, hidden=r.spec.hidden,
        act_bytes=r.layout.precision.act, ep=args.ep, moe_layers=r.spec.layers // args.pp,
        act_ckpt=r.work.act_ckpt,
    )  # fmt: skip
    bandwidth = (args.bandwidth_gbps or r.device.intra_gbps) * 1e9
    return {
        "experts": args.experts, "top_k": args.top_k, "ep": args.ep,
        "all_to_alls": traffic.all_to_alls, "message_bytes": traffic.message,
        "bus_bytes": traffic.bus_bytes, "all_to_all_s": traffic.bus_bytes / bandwidth,
    }  # fmt: skip


def section(args: argparse.Namespace, r: Report) -> dict[str, Any] | None:
    """The section's figures, or None without ``--pp`` and ``--experts``."""
    if args.ep > 1 and not args.experts:
        raise ValueError(f"--ep {args.ep} needs --experts E (a multiple of it)")
    if args.pp == 1 and not args.experts:
        return None
    out: dict[str, Any] = {}
    if args.pp > 1:
        out["pipeline"] = _pipeline(args, r)
    if args.experts:
        out["experts"] = _experts(args, r)
    base = out["pipeline"]["step_s"] if "pipeline" in out else r.time.step_s
    out["step_s"] = base + out.get("experts", {}).get("all_to_all_s", 0.0)
    gpus = r.layout.tp * r.layout.cp * args.pp  # the GPUs sharing a data-parallel rank's batch
    out["tokens_per_s"] = r.work.tokens / out["step_s"] / gpus
    return out


def format_section(s: dict[str, Any]) -> str:
    """Human-readable lines of :func:`section`."""
    lines = ["", "pipeline and experts (per rank)"]
    if "pipeline" in s:
        p = s["pipeline"]
        lines += [
            f"  {p['schedule']}, pp {p['pp']}, {p['microbatches']} microbatches, "
            f"{p['stages_per_rank']} stage(s) per rank",
            f"  bubble                        {p['bubble']:>10.1%}",
            f"  activations held (microbatches) {p['held_microbatches']:>8.2f}",
            f"  stage activations             {p['stage_activations'] / GIB:>10.2f} GiB",
            f"  stage model states            {p['stage_model_states'] / GIB:>10.2f} GiB",
            f"  pipeline step                 {p['step_s']:>10.3f} s",
        ]
        for rank, sm in p.get("stage_memory", {}).items():
            lines += [
                f"  {rank} (stages {sm['stages']}, blocks {sm['blocks']}), FSDP2 under PP:",
                f"    allocated peak (at {sm['peak_phase']}) {sm['peak'] / GIB:.2f} GiB",
                f"    reserved (est.: torch.cuda.max_memory_reserved) "
                f"{sm['reserved_est'] / GIB:.2f} GiB",
            ]
    if "experts" in s:
        e = s["experts"]
        lines += [
            f"  {e['experts']} experts, top-{e['top_k']}, ep {e['ep']}: {e['all_to_alls']} "
            f"all-to-alls, {e['bus_bytes'] / GIB:.2f} GiB out, {e['all_to_all_s']:.3f} s",
        ]
    lines.append(f"  step with both                {s['step_s']:>10.3f} s")
    lines.append(f"  tokens/s per GPU              {s['tokens_per_s']:>10,.0f}")
    return "\n".join(lines)
