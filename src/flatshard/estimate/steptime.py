"""Step time: compute at a given MFU plus the communication that overlap cannot hide.

Volumes are *bus bytes* per rank (nccl-tests' convention): a collective over ``n`` ranks on a
buffer of ``S`` bytes moves ``S (n-1)/n`` for all-gather and reduce-scatter and ``2 S (n-1)/n``
for all-reduce, so its time is that volume over the bus bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..comm.gloo_p2p import MAX_P2P_WORLD
from .devices import Device
from .schedule import gathered_per_step
from .spec import Layout, ModelSpec, Workload
from .units import Units, plan_units

__all__ = ["StepTime", "estimate_time"]


@dataclass(frozen=True)
class StepTime:
    """One training step of one micro-batch per rank."""

    flops: float
    """Model FLOPs per rank (PaLM's formula; x4/3 with activation checkpointing)."""
    compute_s: float
    """``flops / (peak * mfu)``."""
    all_gather_bytes: float
    """Bus bytes per rank of every gather the step's replay starts (``schedule.py``): under
    full_shard the root (again in backward for a tied lazy root), its tail once, and every
    block twice (forward and backward) but those kept into the backward: the last block's
    bucket, or without a tail the last block."""
    reduce_scatter_bytes: float
    all_reduce_bytes: float
    """no_shard's gradient all-reduce; hybrid_shard's all-reduce of gradient shards."""
    comm_s: float
    """All communication back to back."""
    exposed_comm_s: float
    """What overlap leaves on the critical path."""
    step_s: float
    tokens_per_s: float
    """Per rank."""
    mfu: float
    """Achieved model FLOPs utilisation including exposed communication."""


def _volumes(units: Units, layout: Layout) -> tuple[float, float, float]:
    """(all-gather, reduce-scatter, all-reduce) bus bytes per rank per step."""
    w, p = layout.shard_world, layout.precision
    flat = sum(u.pad for u in units.all)  # every unit reduced once (a bucket: the same bytes)
    gather_elems = gathered_per_step(units, layout) if w > 1 else 0
    f = (w - 1) / w
    # Gloo beyond gloo_p2p's ring (more than 8 ranks): an all-reduce of the flat gradient.
    rs_factor = 2 if layout.backend == "gloo" and w > MAX_P2P_WORLD else 1
    ag, rs = gather_elems * p.param * f, rs_factor * flat * p.flat * f
    replicas = layout.world // w
    ar = 2 * (flat // w) * p.flat * (replicas - 1) / replicas
    return ag, rs, ar


def estimate_time(
    spec: ModelSpec,
    layout: Layout,
    work: Workload,
    device: Device,
    *,
    mfu: float | None = None,
    intra_gbps: float | None = None,
    inter_gbps: float | None = None,
    overlap: float | None = None,
) -> StepTime:
    """Step time on ``device``. The first all-gathers (the root, its tail and the first block
    or bucket) and the last reduce-scatters (the root and its tail) cannot overlap anything;
    ``overlap`` (default: the device's) of the rest hides under compute, and whatever exceeds
    the compute time stays exposed."""
    mfu = device.mfu if mfu is None else mfu
    overlap = device.overlap if overlap is None else overlap
    if not 0 < mfu <= 1 or not 0 <= overlap <= 1:
        raise ValueError(f"mfu={mfu} must be in (0, 1] and overlap={overlap} in [0, 1]")
    flops = spec.flops_per_token(work.seq) * work.tokens * (4 / 3 if work.act_ckpt else 1)
    compute = flops / (device.flops[layout.precision.name] * mfu)
    intra = (intra_gbps or device.intra_gbps) * 1e9
    inter = (inter_gbps or device.inter_gbps) * 1e9
    shard_bw = intra if layout.shard_world <= device.per_node else inter
    replicate_bw = intra if layout.world <= device.per_node else inter
    units = plan_units(spec, layout)
    ag, rs, ar = _volumes(units, layout)
    comm = (ag + rs) / shard_bw + ar / replicate_bw
    f = (layout.shard_world - 1) / layout.shard_world
    root = units.root.pad + (units.tail.pad if units.tail else 0)
    block = units.block.pad * len(units.bucket_of(0) or (0,))
    first = (root + block) * layout.precision.param * f / shard_bw
    last = root * layout.precision.flat * f / shard_bw
    rest = max(0.0, comm - first - last)
    exposed = first + last + (1 - overlap) * rest + max(0.0, overlap * rest - compute)
    step = compute + exposed
    return StepTime(
        flops=flops,
        compute_s=compute,
        all_gather_bytes=ag,
        reduce_scatter_bytes=rs,
        all_reduce_bytes=ar,
        comm_s=comm,
        exposed_comm_s=exposed,
        step_s=step,
        tokens_per_s=work.tokens / step,
        mfu=flops / (device.flops[layout.precision.name] * step) / (4 / 3 if work.act_ckpt else 1),
    )
