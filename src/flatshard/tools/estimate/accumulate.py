"""Gradient accumulation: an optimizer step of several micro-batches (``--grad-accum``).

[Note: the estimator's gradient accumulation]
flatshard offers two ways to accumulate (``flatshard/accumulate.py``, ``fs.no_sync``):
``keep="unsharded"`` keeps every unit's flat gradient across the micro-batches and reduces the
sum once, on the first backward outside the block; ``keep="sharded"`` reduce-scatters every
micro-batch. The first is the one to pick for throughput (its docstring: "default, fastest"),
so it is what the estimate models; the second is ``N`` ordinary steps.

Time. Under ``full_shard`` a unit is still released after its forward and its backward inside
``no_sync`` (``core/unit_views.call_done`` reshards whatever the mode; only the reduction is
deferred), so every micro-batch gathers the parameters as an ordinary step does. The step is
``(N - 1)`` micro-batches that gather and reduce nothing (``estimate_time(reduce=False)``:
compute, the exposed gathers, TP and CP as usual) plus one ordinary step, which reduces the
accumulated flat gradients once. Under ``fs.pipeline_step`` the same holds per microbatch
(``parallel/pipeline_step.py``: one gather per unit per microbatch forward and backward, one
reduction per unit per step), and with ``keep_gathered=True`` the units gathered once stay so
to the step's end: the accumulating microbatches gather nothing (``estimate_time(reduce=False,
gather=False)``) and the last one is the ordinary step. ``published.py`` models its pipeline
rows either way (``PublishedRun.keep_gathered``).

Memory. Each unit's flat gradient (its padded size in the reduce dtype,
``core/reduce.flat_grad_from``) stays from the first micro-batch's backward to the last one's
reduction: one model-sized gradient buffer per GPU (of the GPU's TP share). The replayed
phases of one micro-batch (``memory.py``) are the last micro-batch's; the estimate adds the
whole buffer to every phase but the optimizer step (by then the reductions freed it). That is
an upper bound: in the last micro-batch's backward the units already reduced no longer hold
theirs, and an accumulating micro-batch has no reduction in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

from flatshard.tools.estimate.cp_cost import cp_view
from flatshard.tools.estimate.devices import Device
from flatshard.tools.estimate.memory import MemoryEstimate
from flatshard.tools.estimate.spec import Layout, ModelSpec, Workload
from flatshard.tools.estimate.steptime import StepTime, estimate_time
from flatshard.tools.estimate.units import plan_units

__all__ = [
    "AccumulatedStep",
    "Accumulation",
    "accumulated_grad_bytes",
    "accumulated_peak",
    "accumulated_step",
    "accumulation",
    "accumulation_json",
    "check_grad_accum",
    "format_accumulation",
]


def check_grad_accum(n: object) -> int:
    """``n`` micro-batches per optimizer step, a positive integer."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"--grad-accum {n!r}: give the micro-batches per optimizer step, an "
                         "integer >= 1 (1 = no accumulation)")  # fmt: skip
    return n


@dataclass(frozen=True)
class AccumulatedStep:
    """One optimizer step of ``microbatches`` micro-batches, per GPU."""

    microbatches: int
    accumulating: StepTime
    """One micro-batch inside ``fs.no_sync(keep="unsharded")``: gathers, no reduction."""
    last: StepTime
    """The last micro-batch, outside the block: an ordinary step (it reduces the sum)."""
    step_s: float
    """``(microbatches - 1) * accumulating.step_s + last.step_s``."""
    tokens_per_s: float
    """Per GPU: ``microbatches`` micro-batches' tokens over the step and the ``cp x tp``
    GPUs of a data-parallel rank."""


def accumulated_step(
    spec: ModelSpec,
    layout: Layout,
    work: Workload,
    device: Device,
    microbatches: int,
    keep_gathered: bool = False,
    **time_kw: float | None,
) -> AccumulatedStep:
    """The step of ``microbatches`` micro-batches of ``work`` (see the Note); with
    ``keep_gathered`` the units stay gathered between them (``fs.pipeline_step(schedule,
    keep_gathered=True)``): only the last one, an ordinary step, gathers."""
    n = check_grad_accum(microbatches)
    last = estimate_time(spec, layout, work, device, **time_kw)  # type: ignore[arg-type]
    accum = estimate_time(
        spec, layout, work, device, reduce=False, gather=not keep_gathered, **time_kw
    )  # type: ignore[arg-type]
    step = (n - 1) * accum.step_s + last.step_s
    tokens = n * work.tokens / step / (layout.tp * layout.cp)
    return AccumulatedStep(n, accum, last, step, tokens)


def accumulated_grad_bytes(spec: ModelSpec, layout: Layout, work: Workload) -> int:
    """Bytes per GPU of the flat gradients ``keep="unsharded"`` holds between micro-batches:
    every unit's padded size (under TP the GPU's share) in the reduce dtype."""
    dp, _ = cp_view(layout, work)
    return sum(u.pad for u in plan_units(spec, dp).all) * dp.precision.flat


def accumulated_peak(memory: MemoryEstimate, held: int) -> int:
    """The allocated peak with ``held`` accumulated bytes beside every phase of a micro-batch
    but the optimizer step (an upper bound, see the Note)."""
    return max(p.total + (0 if p.name == "optimizer step" else held) for p in memory.phases)


@dataclass(frozen=True)
class Accumulation:
    """What ``--grad-accum`` adds to a report: the step and the memory it holds."""

    step: AccumulatedStep
    held: int
    """Bytes of the flat gradients kept between micro-batches (:func:`accumulated_grad_bytes`)."""
    peak: int
    """The allocated peak with them (:func:`accumulated_peak`)."""


def accumulation(
    spec: ModelSpec,
    layout: Layout,
    work: Workload,
    device: Device,
    memory: MemoryEstimate,
    microbatches: int,
    **time_kw: float | None,
) -> Accumulation:
    """``--grad-accum``'s figures for one report."""
    held = accumulated_grad_bytes(spec, layout, work)
    acc = accumulated_step(spec, layout, work, device, microbatches, **time_kw)
    return Accumulation(acc, held, accumulated_peak(memory, held))


def format_accumulation(a: Accumulation, unit: int, uname: str) -> list[str]:
    """The report's lines for ``--grad-accum``."""
    s = a.step
    return [
        f"gradient accumulation: {s.microbatches} micro-batches per optimizer step, "
        'fs.no_sync(keep="unsharded")',
        f"  accumulating micro-batch {s.accumulating.step_s * 1e3:12.2f} ms   (gathers, no "
        "reduction)",
        f"  last micro-batch         {s.last.step_s * 1e3:12.2f} ms   (reduces the sum once)",
        f"  optimizer step           {s.step_s * 1e3:12.2f} ms   {s.tokens_per_s:,.0f} "
        "tokens/s/GPU",
        f"  accumulated flat gradients {a.held / unit:10.2f} {uname}, allocated peak with them "
        f"{a.peak / unit:,.2f} {uname}",
    ]


def accumulation_json(a: Accumulation) -> dict:
    """The JSON object ``grad_accum`` (bytes, seconds)."""
    s = a.step
    return {"microbatches": s.microbatches, "mode": 'fs.no_sync(keep="unsharded")',
            "accumulating_step_s": s.accumulating.step_s, "last_step_s": s.last.step_s,
            "step_s": s.step_s, "tokens_per_s": s.tokens_per_s,
            "accumulated_grad_bytes": a.held, "peak": a.peak}  # fmt: skip
