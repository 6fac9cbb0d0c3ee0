"""Pipeline bubble, per-stage activation memory and expert all-to-all traffic.

[Note: the estimator's pipeline and expert parallelism]
*Pipeline* (``--pp P --microbatches M --schedule S``, ``V`` stages per rank for the looped
schedules): each rank holds ``1/P`` of the blocks, so its compute, parameters and data-parallel
traffic are ``1/P`` of the unpipelined figures. The time a rank idles while the pipeline
fills and drains, as a share of the step (``bubble``):

* GPipe and 1F1B: ``(P - 1) / (M + P - 1)`` (GPipe, Huang et al. 2019, sec. 2.3; 1F1B has the
  same bubble, Narayanan et al. 2021 "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", eq. 1: bubble time over ideal time ``(P-1)/M``).
* Interleaved 1F1B and LoopedBFS with ``V`` stages per rank: the fill shrinks by ``V``:
  ``(P - 1) / V / (M + (P - 1) / V)`` (Narayanan et al. 2021, sec. 2.2.2: ``(1/V)(P-1)/M``).
* InterleavedZeroBubble, ZBVZeroBubble, DualPipeV: ~0 once ``M >= P`` (Qi et al. 2024 "Zero
  Bubble Pipeline Parallelism": the split weight-gradient pass fills the bubble; DeepSeek-V3's
  DualPipe likewise); with fewer microbatches the 1F1B formula stands (nothing to fill with).

Activations held per rank (the first stage, the worst): GPipe keeps all ``M`` microbatches'
activations until the backward; 1F1B keeps ``min(M, P)`` (its warm-up depth); interleaved
keeps ``min(M, P)`` microbatches plus ``(P - 1) / V`` more (Narayanan et al. 2021, sec. 2.2.2:
the extra warm-up chunks of the looped schedule); the zero-bubble schedules as 1F1B (ZB-H1 and
ZB-V keep 1F1B's peak). Each unit is one microbatch's activations of a ``1/P`` stage.

*Experts* (``--experts E --top-k K --ep N``): every MoE layer sends each token's ``K`` routed
copies to their experts and back, one all-to-all each way in forward and the same two in
backward (a recomputing forward with ``--act-ckpt`` adds two more). One all-to-all moves
``tokens * K * hidden * bytes * (N - 1) / N`` bytes per GPU (the share bound for other ranks).
They sit between the router and the experts: on the critical path, nothing overlaps them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "SCHEDULES",
    "ExpertTraffic",
    "bubble_fraction",
    "expert_traffic",
    "held_microbatches",
]

SCHEDULES = (
    "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
    "DualPipeV",
)  # fmt: skip
"""torch.distributed.pipelining's schedules (the trainer's --parallelism.schedule)."""
INTERLEAVED = ("Interleaved1F1B", "LoopedBFS")
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def _check(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"--schedule {schedule!r} is not known; use one of {', '.join(SCHEDULES)}")
    for name, value in (("--pp", pp), ("--microbatches", microbatches),
                        ("stages per rank", stages_per_rank)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")


def bubble_fraction(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The share of a step a pipeline rank idles (see the Note for each formula's source)."""
    _check(schedule, pp, microbatches, stages_per_rank)
    fill = pp - 1
    if schedule in ZERO_BUBBLE and microbatches >= pp:
        return 0.0
    if schedule in INTERLEAVED or schedule == "InterleavedZeroBubble":
        fill = (pp - 1) / stages_per_rank
    return fill / (microbatches + fill)


def held_microbatches(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Microbatches' worth of one stage's activations the first rank holds at its peak."""
    _check(schedule, pp, microbatches, stages_per_rank)
    if schedule == "GPipe":
        return float(microbatches)
    held = float(min(microbatches, pp))
    if schedule in INTERLEAVED and microbatches > pp:
        held += (pp - 1) / stages_per_rank
    return held


@dataclass(frozen=True)
class ExpertTraffic:
    """The expert-parallel all-to-alls of one step, per GPU."""

    all_to_alls: int
    """All-to-alls per step: 4 per MoE layer (6 with activation checkpointing)."""
    message: int
    """Bytes of one layer's routed tokens: ``tokens * top_k * hidden * bytes``."""
    bus_bytes: float
    """What leaves this GPU: ``all_to_alls * message * (ep - 1) / ep``."""


def expert_traffic(
    *, tokens: int, top_k: int, hidden: int, act_bytes: int, ep: int, moe_layers: int,
    act_ckpt: bool = False,
) -> ExpertTraffic:  # fmt: skip
    """The all-to-all volume of one step (see the Note); none with ``ep = 1``."""
    for name, value in (("--top-k", top_k), ("--ep", ep), ("tokens", tokens)):
        if value < 1:
            raise ValueError(f"{name}={value} must be a positive integer")
    count = moe_layers * (6 if act_ckpt else 4)
    message = tokens * top_k * hidden * act_bytes
    if ep == 1:
        return ExpertTraffic(count, message, 0.0)
    return ExpertTraffic(count, message, count * message * (ep - 1) / ep)
