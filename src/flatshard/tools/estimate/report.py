"""Turn an estimate into a plain-text table and a JSON-ready dict."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flatshard.tools.estimate.accumulate import (
    Accumulation,
    accumulation_json,
    format_accumulation,
)
from flatshard.tools.estimate.devices import Device
from flatshard.tools.estimate.memory import MemoryEstimate
from flatshard.tools.estimate.reserved import Reserved
from flatshard.tools.estimate.spec import Layout, ModelSpec, Workload
from flatshard.tools.estimate.steptime import StepTime
from flatshard.tools.estimate.tp_cost import local_spec, tp_traffic
from flatshard.tools.estimate.units import plan_units

__all__ = ["Report", "format_table", "to_json"]

GIB, MIB = 2**30, 2**20
COMPONENTS = (  # (key, label, note)
    ("parameters", "parameters", "this rank's fp32 storage"),
    ("gradients", "gradients", ".grad at the end of backward"),
    ("optimizer", "optimizer state", "of this rank's parameters"),
    ("buffers", "buffers", "RoPE tables, replicated"),
    ("gathered_peak", "gathered units", "peak of full buffers at once"),
    ("activations", "activations", "saved at the end of forward"),
    ("peak", "allocated peak", ""),
)


@dataclass(frozen=True)
class Report:
    """Everything one ``flatshard estimate`` run computed."""

    spec: ModelSpec
    layout: Layout
    work: Workload
    device: Device
    memory: MemoryEstimate
    time: StepTime
    fits: bool | None
    """Peak within the device memory (``None``: no capacity known)."""
    min_world: dict[str, int | None]
    """Smallest world size at which the peak fits, per strategy (``None``: never)."""
    measured: dict[str, int] | None = None
    reserved: Reserved | None = None
    """Estimated ``torch.cuda.max_memory_reserved`` (what torchtitan reports), beside the
    allocated peak (``reserved.py``)."""
    accumulation: Accumulation | None = None
    """``--grad-accum N > 1``: the optimizer step of N micro-batches (``accumulate.py``)."""


def _fmt(n: float, unit: int) -> str:
    return f"{n / unit:,.2f}"


def _header(r: Report) -> list[str]:
    s, lay, w, p = r.spec, r.layout, r.work, r.layout.precision
    tied = "tied" if s.tied else "untied"
    shard_world = lay.shard_world * lay.cp  # FSDP over the flattened dp x cp mesh
    shard = f"shard over {shard_world}" if shard_world > 1 else "replicated"
    return [
        f"model   {s.name}: {s.params:,} parameters ({s.params / 1e9:.3g} B); {s.layers} layers, "
        f"hidden {s.hidden}, heads {s.heads} (kv {s.kv_heads}), ffn {s.ffn} {s.mlp}, "
        f"vocab {s.vocab} {tied}",
        f"layout  {_world(lay)}, {lay.strategy} ({shard}), {p.name} "
        f"(reduce {p.reduce or p.name}), "
        f"{lay.optimizer}, {lay.backend}, {_units(r)}",
        *_tp_header(r),
        f"batch   {w.batch} x {w.seq} tokens per {'data-parallel ' if lay.tp > 1 else ''}rank, "
        f"{w.attention} attention" + _execution(w),
    ]


def _execution(w: Workload) -> str:
    """Checkpointing, compile and float8, as the header lists them."""
    ac = ", activation checkpointing" if w.act_ckpt else ""
    ac += ", selective (per-op) checkpointing" if w.selective_ac else ""
    return ac + (", torch.compile" if w.compile else "") + (", float8" if w.float8 else "")


def _world(lay: Layout) -> str:
    if lay.tp == 1 and lay.cp == 1:
        return f"world {lay.world}"
    axes = "".join(f" x {name} {n}" for name, n in (("cp", lay.cp), ("tp", lay.tp)) if n > 1)
    return f"world {lay.world}{axes} = {lay.gpus} GPUs"


def _tp_header(r: Report) -> list[str]:
    """What one GPU of a tp group holds (see tp_cost.py); nothing at tp 1."""
    lay = r.layout
    if lay.tp == 1:
        return []
    s = local_spec(r.spec, lay.tp)
    sp = "sequence parallel" if lay.sequence_parallel else "no sequence parallel"
    return [
        f"tp      {lay.tp} ({sp}; torchtitan's plan): per GPU heads {s.heads} (kv "
        f"{s.kv_heads}), ffn {s.ffn}, vocab {s.vocab}; norm weights replicated over tp"
    ]


def _units(r: Report) -> str:
    """What fs.shard's coalesce/split_root defaults make of the blocks and the root."""
    units = plan_units(r.spec, r.layout)
    if units.buckets:
        sizes = "/".join(str(n) for n in sorted({len(b) for b in units.buckets}, reverse=True))
        buckets = f"{len(units.buckets)} bucket(s) of {sizes} blocks"
    else:
        buckets = "no bucket" if r.layout.coalesce else "coalesce off"
    if units.tail is None:
        return f"{buckets}, root whole"
    return f"{buckets}, root + tail" + (" (lazy root)" if units.lazy_root else "")


def format_table(r: Report) -> str:
    """The human-readable report: memory components, the peak's breakdown, time, fit."""
    m = r.memory
    unit, uname = (GIB, "GiB") if m.peak >= GIB else (MIB, "MiB")
    lines = [*_header(r), ""]
    meas = r.measured
    head = f"{'memory per rank (rank 0)':<52}{uname:>12}"
    lines.append(head + (f"{'measured':>12}{'diff':>9}" if meas else ""))
    for key, label, note in COMPONENTS:
        value = getattr(m, key)
        name = f"  {label} ({note})" if note else f"  {label} (at {m.peak_phase})"
        row = f"{name:<52}{_fmt(value, unit):>12}"
        if meas and key in meas:
            diff = 100 * (value - meas[key]) / meas[key] if meas[key] else 0.0
            row += f"{_fmt(meas[key], unit):>12}{diff:>+8.2f}%"
        lines.append(row)
    per_param = m.model_states / r.spec.params
    states = f"  model states (params+grads+optimizer, {per_param:.3g} B/param)"
    row = f"{states:<52}{_fmt(m.model_states, unit):>12}"
    if meas:
        measured = meas["parameters"] + meas["gradients"] + meas["optimizer"]
        row += f"{_fmt(measured, unit):>12}{100 * (m.model_states - measured) / measured:>+8.2f}%"
    lines.append(row)
    lines.append("  peak breakdown: " + ", ".join(
        f"{k} {_fmt(v, unit)}" for k, v in m.peak_parts.items() if v))  # fmt: skip
    lines += _reserved_lines(r.reserved, unit)
    lines += ["", *_time_lines(r), ""]
    if r.accumulation:
        lines += [*format_accumulation(r.accumulation, unit, uname), ""]
    lines += _fit_lines(r)
    return "\n".join(lines)


def _time_lines(r: Report) -> list[str]:
    t, d = r.time, r.device
    peak = d.flops[r.layout.precision.name]
    return [
        f"step time on {d.name} (peak {peak / 1e12:,.1f} TFLOP/s {r.layout.precision.name})",
        f"  compute           {t.compute_s * 1e3:12.2f} ms   ({t.flops:.3g} FLOPs)",
        f"  all-gather        {t.all_gather_bytes / 1e9:12.3f} GB bus bytes",
        f"  reduce-scatter    {t.reduce_scatter_bytes / 1e9:12.3f} GB",
        f"  all-reduce        {t.all_reduce_bytes / 1e9:12.3f} GB",
        f"  communication     {t.comm_s * 1e3:12.2f} ms   "
        f"(exposed after overlap {t.exposed_comm_s * 1e3:.2f} ms)",
        *_tp_time(r),
        *_cp_time(r),
        f"  step              {t.step_s * 1e3:12.2f} ms   {t.tokens_per_s:,.0f} tokens/s/"
        f"{'GPU' if r.layout.gpus > r.layout.world else 'rank'}, "
        f"MFU {100 * t.mfu:.1f}%",
    ]


def _tp_time(r: Report) -> list[str]:
    """The tensor-parallel collectives' line (tp > 1 only)."""
    if r.layout.tp == 1:
        return []
    tp = tp_traffic(r.spec, r.layout, r.work)
    if r.layout.sequence_parallel:
        what = f"{tp.all_gathers} all-gathers + {tp.reduce_scatters} reduce-scatters"
    else:
        what = f"{tp.all_reduces} all-reduces"
    return [
        f"  tensor parallel   {tp.bus_bytes / 1e9:12.3f} GB bus bytes: {what} of "
        f"{tp.message / 1e6:,.1f} MB over tp {r.layout.tp}",
        f"  tp communication  {r.time.tp_comm_s * 1e3:12.2f} ms   "
        f"(exposed {r.time.tp_exposed_s * 1e3:.2f} ms)",
    ]


def _cp_time(r: Report) -> list[str]:
    """The context-parallel ring's line (cp > 1 only)."""
    if r.layout.cp == 1:
        return []
    t = r.time
    return [
        f"  cp ring           {t.cp_bytes / 1e9:12.3f} GB bus bytes of K/V over cp "
        f"{r.layout.cp}: {t.cp_comm_s * 1e3:.2f} ms (exposed {t.cp_exposed_s * 1e3:.2f} ms)"
    ]


def _reserved_lines(res: Reserved | None, unit: int) -> list[str]:
    """The reserved estimate, labelled so that it is compared with ``max_memory_reserved``
    (torchtitan's "memory") and the allocated peak with ``max_memory_allocated``."""
    if res is None:
        return []
    name = "  reserved (est.: torch.cuda.max_memory_reserved)"
    held = {"FSDP2's held root": res.root_held}
    within = ", ".join(f"{k.replace('_', ' ')} {_fmt(v, unit)}"
                       for k, v in (held | res.loss_extra).items() if v)  # fmt: skip
    parts = [f"{k.replace('_', ' ')} {_fmt(v, unit)}" for k, v in res.parts.items() if v]
    parts[0] += f" (counting, where they apply: {within})" if within else ""
    return [f"{name:<52}{_fmt(res.total, unit):>12}",
            f"  reserved breakdown ({res.runtime}'s streams): " + ", ".join(parts)]  # fmt: skip


def _fit_lines(r: Report) -> list[str]:
    cap = r.device.memory_gib
    if cap is None:
        return ["fit: no device memory given (--memory-gib)"]
    verdict = "fits" if r.fits else "does NOT fit"
    peak = (r.accumulation.peak if r.accumulation else r.memory.peak) / GIB
    what = "allocated peak" + (" with the accumulated gradients" if r.accumulation else "")
    out = [f"fit: {what} {peak:,.1f} GiB {verdict} in {cap:g} GiB per rank"]
    mins = ", ".join(f"{k} {v if v else 'never'}" for k, v in r.min_world.items())
    if r.layout.tp > 1:
        out.append(f"  smallest data-parallel world that fits (tp {r.layout.tp}, same batch "
                   f"per data-parallel rank): {mins}")  # fmt: skip
    else:
        out.append(f"  smallest world that fits (same batch per rank): {mins}")
    return out


def to_json(r: Report) -> dict:
    """A JSON-ready dict with every input and figure (bytes, seconds)."""
    m = r.memory
    memory = {key: getattr(m, key) for key, _, _ in COMPONENTS}
    memory |= {"model_states": m.model_states, "peak_phase": m.peak_phase,
               "peak_parts": m.peak_parts, "peak_kind": "allocated (live tensors)",
               "phases": [{"name": p.name, "total": p.total} for p in m.phases]}  # fmt: skip
    return {
        "model": dataclasses.asdict(r.spec) | {"params": r.spec.params},
        "layout": dataclasses.asdict(r.layout)
        | {"shard_world": r.layout.shard_world, "gpus": r.layout.gpus},
        "tensor_parallel": _tp_json(r),
        "workload": dataclasses.asdict(r.work),
        "device": dataclasses.asdict(r.device),
        "memory_bytes": memory | _reserved_json(r.reserved),
        "time": dataclasses.asdict(r.time),
        "fits": r.fits,
        "min_world": r.min_world,
        "measured_bytes": r.measured,
        "grad_accum": accumulation_json(r.accumulation) if r.accumulation else None,
    }


def _reserved_json(res: Reserved | None) -> dict:
    if res is None:
        return {}
    return {"reserved_est": res.total, "reserved_runtime": res.runtime,
            "reserved_parts": res.parts | {"root_held": res.root_held} | {
                f"loss_{k}": v for k, v in res.loss_extra.items()}}  # fmt: skip


def _tp_json(r: Report) -> dict:
    """The tp degree, what one GPU holds of the model, and the TP collectives of a step."""
    local = local_spec(r.spec, r.layout.tp)
    traffic = tp_traffic(r.spec, r.layout, r.work)
    return {
        "tp": r.layout.tp,
        "sequence_parallel": r.layout.sequence_parallel,
        "gpus": r.layout.gpus,
        "per_gpu": {k: getattr(local, k) for k in ("heads", "kv_heads", "ffn", "vocab")},
        "collectives": dataclasses.asdict(traffic) | {"bus_bytes": traffic.bus_bytes},
        "comm_s": r.time.tp_comm_s,
    }
