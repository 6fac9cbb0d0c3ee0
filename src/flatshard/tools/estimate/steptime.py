"""Step time: compute (``efficiency.py``) plus the communication that overlap cannot hide.

Volumes are *bus bytes* per rank (nccl-tests' convention): a collective over ``n`` ranks on a
buffer of ``S`` bytes moves ``S (n-1)/n`` for all-gather and reduce-scatter and ``2 S (n-1)/n``
for all-reduce, so its time is that volume over the bus bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from flatshard.comm.gloo_p2p import MAX_P2P_WORLD
from flatshard.tools.estimate.cp_cost import cp_traffic, cp_view
from flatshard.tools.estimate.devices import Device
from flatshard.tools.estimate.efficiency import (
    attention_seconds,
    compute_seconds,
    step_flops,
    tp_hidden_share,
)
from flatshard.tools.estimate.schedule import gathered_per_step
from flatshard.tools.estimate.spec import Layout, ModelSpec, Workload
from flatshard.tools.estimate.tp_cost import tp_traffic
from flatshard.tools.estimate.units import Units, plan_units

__all__ = ["StepTime", "estimate_time"]


@dataclass(frozen=True)
class StepTime:
    """One training step of one micro-batch per data-parallel rank, per GPU."""

    flops: float
    """FLOPs per GPU the step executes (``efficiency.step_flops``: 1/(cp tp) of the
    micro-batch's, recomputation included)."""
    compute_s: float
    """``efficiency.compute_seconds``: the FLOPs by kind over ``peak * mfu``, with the compile
    and float8 speedups."""
    all_gather_bytes: float
    """Bus bytes per rank of every gather the step's replay starts (``schedule.py``): under
    full_shard the root (again in backward for a tied lazy root), its tail once, and every
    block twice (forward and backward) but those kept into the backward: the last block's
    bucket, or without a tail the last block."""
    reduce_scatter_bytes: float
    all_reduce_bytes: float
    """no_shard's gradient all-reduce; hybrid_shard's all-reduce of gradient shards."""
    comm_s: float
    """All data-parallel communication back to back."""
    exposed_comm_s: float
    """What overlap leaves of the data-parallel communication on the critical path."""
    tp_all_gather_bytes: float
    """Bus bytes per GPU of the tensor-parallel all-gathers (sequence parallel; 0 at tp 1)."""
    tp_reduce_scatter_bytes: float
    """Bus bytes per GPU of the tensor-parallel reduce-scatters (sequence parallel)."""
    tp_all_reduce_bytes: float
    """Bus bytes per GPU of the tensor-parallel all-reduces (without sequence parallel)."""
    tp_comm_s: float
    """Tensor-parallel communication back to back."""
    tp_exposed_s: float
    """What of it stays on the critical path: all of it eager; compile and async TP hide a
    share (``efficiency.VANILLA_TP_HIDDEN``, ``ASYNC_TP_HIDDEN``)."""
    cp_bytes: float
    """Bus bytes per GPU of the context-parallel ring (``cp_cost.py``; 0 at cp 1)."""
    cp_comm_s: float
    """The ring's transfers back to back."""
    cp_exposed_s: float
    """What of the ring exceeds the attention compute it overlaps."""
    step_s: float
    """``compute_s + exposed_comm_s + tp_exposed_s + cp_exposed_s``."""
    tokens_per_s: float
    """Per GPU (a data-parallel rank's tokens over its ``cp x tp`` GPUs)."""
    mfu: float
    """Achieved model FLOPs utilisation: PaLM's model FLOPs (no recomputation) over the
    peak and the step."""


def _volumes(
    units: Units, layout: Layout, reduce: bool, gather: bool = True
) -> tuple[float, float, float]:
    """(all-gather, reduce-scatter, all-reduce) bus bytes per rank per step; without
    ``reduce`` (a micro-batch under ``fs.no_sync(keep="unsharded")``) the gathers only;
    without ``gather`` (a microbatch whose units stay gathered) no all-gather."""
    w, p = layout.shard_world, layout.precision
    flat = sum(u.pad for u in units.all)  # every unit reduced once (a bucket: the same bytes)
    gather_elems = gathered_per_step(units, layout) if w > 1 and gather else 0
    f = (w - 1) / w
    # Gloo beyond gloo_p2p's ring (more than 8 ranks): an all-reduce of the flat gradient.
    rs_factor = 2 if layout.backend == "gloo" and w > MAX_P2P_WORLD else 1
    ag, rs = gather_elems * p.param * f, rs_factor * flat * p.flat * f
    replicas = layout.world // w
    ar = 2 * (flat // w) * p.flat * (replicas - 1) / replicas
    return (ag, rs, ar) if reduce else (ag, 0.0, 0.0)


def _links(
    layout: Layout, device: Device, intra_gbps: float | None, inter_gbps: float | None
) -> tuple[float, float, float]:
    """Bus bandwidth (bytes/s) of the dp shard group, the dp replicate group and the tp
    group. GPUs are numbered tp-innermost (torchtitan's mesh order ``dp, tp``): a tp group is
    ``tp`` neighbours, a dp group strides by ``tp``, so it stays within a node only when
    its ranks times ``tp`` GPUs do."""
    intra = (intra_gbps or device.intra_gbps) * 1e9
    inter = (inter_gbps or device.inter_gbps) * 1e9

    def link(gpus: int) -> float:
        return intra if gpus <= device.per_node else inter

    tp = layout.tp
    return link(layout.shard_world * tp), link(layout.world * tp), link(tp)


def _exposed(
    units: Units,
    layout: Layout,
    comm: float,
    compute: float,
    overlap: float,
    shard_bw: float,
    reduce: bool = True,
    gather: bool = True,
) -> float:
    """The data-parallel communication left on the critical path: the first all-gathers (the
    root, its tail and the first block or bucket) and the last reduce-scatters (the root and
    its tail; none without ``reduce``) overlap nothing; ``overlap`` of the rest hides under
    compute, and whatever exceeds the compute time stays exposed."""
    f = (layout.shard_world - 1) / layout.shard_world
    root = units.root.pad + (units.tail.pad if units.tail else 0)
    block = units.block.pad * len(units.bucket_of(0) or (0,))
    first = (root + block) * layout.precision.param * f / shard_bw if gather else 0.0
    last = root * layout.precision.flat * f / shard_bw if reduce else 0.0
    rest = max(0.0, comm - first - last)
    return first + last + (1 - overlap) * rest + max(0.0, overlap * rest - compute)


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
    reduce: bool = True,
    gather: bool = True,
) -> StepTime:
    """Step time of one GPU on ``device``: compute (``efficiency.py``), the data-parallel
    communication that overlap leaves exposed (:func:`_exposed`; ``overlap`` defaults to the
    device's), the tensor-parallel collectives, which sit between a block's matmuls (all
    exposed eager; compile and async TP hide a share), and the context-parallel ring, which
    hides under attention. ``reduce=False``: a micro-batch accumulated under
    ``fs.no_sync(keep="unsharded")``, which gathers as usual and reduces nothing
    (``accumulate.py``); ``gather=False`` also gathers nothing: a microbatch of a stage kept
    gathered for the step (``fs.pipeline_step(keep_gathered=True)``)."""
    mfu = device.mfu if mfu is None else mfu
    overlap = device.overlap if overlap is None else overlap
    if not 0 < mfu <= 1 or not 0 <= overlap <= 1:
        raise ValueError(f"mfu={mfu} must be in (0, 1] and overlap={overlap} in [0, 1]")
    flops = step_flops(spec, layout, work)
    compute = compute_seconds(flops, spec, layout, work, device, mfu)
    dp, dp_work = cp_view(layout, work)  # FSDP over the flattened dp x cp mesh
    shard_bw, replicate_bw, tp_bw = _links(dp, device, intra_gbps, inter_gbps)
    units = plan_units(spec, dp)
    ag, rs, ar = _volumes(units, dp, reduce, gather)
    comm = (ag + rs) / shard_bw + ar / replicate_bw
    exposed = _exposed(units, dp, comm, compute, overlap, shard_bw, reduce, gather)
    tp = tp_traffic(spec, dp, dp_work)
    tp_s = tp.bus_bytes / tp_bw
    tp_exposed = tp_s * (1 - tp_hidden_share(layout, work))
    ring = cp_traffic(spec, layout, work).bus_bytes
    cp_s = ring / _cp_link(layout, device, intra_gbps, inter_gbps)
    cp_exposed = max(0.0, cp_s - attention_seconds(flops, layout, work, device, mfu))
    step = compute + exposed + tp_exposed + cp_exposed
    peak = device.flops[layout.precision.name]
    return StepTime(
        flops=flops.executed,
        compute_s=compute,
        all_gather_bytes=ag,
        reduce_scatter_bytes=rs,
        all_reduce_bytes=ar,
        comm_s=comm,
        exposed_comm_s=exposed,
        tp_all_gather_bytes=tp.all_gather_bytes,
        tp_reduce_scatter_bytes=tp.reduce_scatter_bytes,
        tp_all_reduce_bytes=tp.all_reduce_bytes,
        tp_comm_s=tp_s,
        tp_exposed_s=tp_exposed,
        cp_bytes=ring,
        cp_comm_s=cp_s,
        cp_exposed_s=cp_exposed,
        step_s=step,
        tokens_per_s=work.tokens / step / (layout.tp * layout.cp),
        mfu=flops.model / (peak * step),
    )


def _cp_link(
    layout: Layout, device: Device, intra_gbps: float | None, inter_gbps: float | None
) -> float:
    """Bus bandwidth of the cp ring: within a node while its ``cp x tp`` GPUs fit in one."""
    gbps = intra_gbps or device.intra_gbps
    if layout.cp * layout.tp > device.per_node:
        gbps = inter_gbps or device.inter_gbps
    return gbps * 1e9
