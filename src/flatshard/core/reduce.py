"""The gradient reduction of one unit's flat group: one path.

[Note: one reduction path]
A flat group's gradient travels one way (``reduce_chunked``):

    flat gradient, viewed as chunked [world, S]           row r: chunk r
                     --divide (pre)--> reduce-scatter SUM over the shard group
                     --then--> all-reduce SUM over the replicate group (hybrid_shard)
                     --then--> divide (post)              pre * post = data-parallel world
    this rank's row = the group's gradient shard  --assign--> fragment .grad

A unit reduces each trainable group (``reduce_group``): its padded flat gradient *is* the
chunked buffer (``[world, S]``, no copy); a bucket of coalesced units is one unit (see
[Note: coalesced units] in buckets.py), so it takes this path too. Two shortcuts change the
collective's inputs, not its sums: ``no_shard`` (no shard group: the flat gradient is the
shard's gradient, only the replicate all-reduce runs) and the
per-parameter pieces of a Gloo point-to-point group (``reduces_pieces``: the ring sends each
parameter's part of a chunk straight from autograd's gradient, no flat copy). The mean is a
sum then a division, split around the sum for fp16 (``precision.sum_scaling``). A wire
format (``fs.Comm(reduce="bf16")``) changes the collective, not the sums' dtype: the
reduce-scatter becomes an all-to-all in bf16 and an fp32 sum where the chunks arrive
(``reduce_on_wire``, [Note: a narrow wire, a wide sum]); ``"int8"``/``"fp8"`` quantize
blockwise before that all-to-all (``reduce_quantized``, comm/quantize.py). After the
wait, the ranks agree on which parameters were used (usage.py) and ``assign_grads`` hands
out the slices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from flatshard.comm import quantize
from flatshard.comm.collectives import (
    CommStats,
    PendingWork,
    all_reduce_sum,
    all_to_all_sum,
    quantized_all_to_all_sum,
    reduce_scatter_pieces_sum,
    reduce_scatter_sum,
    sends_from_pieces,
    then_issue,
)
from flatshard.core.flat_group import FlatGroup
from flatshard.core.layout import chunk_spans
from flatshard.core.mesh import Topology
from flatshard.core.streams import NO_STREAMS, on_side_stream
from flatshard.features.error_feedback import quantize_with_feedback
from flatshard.offload import copy_to_host
from flatshard.precision import QUANTIZED_WIRES, sum_scaling, wire_dtype

PIECES_MIN_BYTES = 1 << 20  # see reduces_pieces
Grad = torch.Tensor | tuple  # a padded flat gradient, or per-parameter ones (None: unused)


@dataclass
class PendingReduce:
    """One group's gradient reduction in flight: the mirror of a pending gather."""

    group: FlatGroup
    grad_shard: torch.Tensor  # this rank's part of the averaged gradient, once ``wait`` returns
    used: torch.Tensor  # bool per parameter: used on this rank in this backward
    work: PendingWork

    def wait(self, timeout) -> None:
        self.work.wait(timeout)

    def assign(self, used_globally: list[bool], stats: CommStats) -> None:
        """Hand the fragments their gradients (after the ranks agreed on usage: host data,
        see [Note: how usage is agreed] in usage.py)."""
        assign_grads(self.group, self.grad_shard, used_globally, stats)


def data_parallel_world(topo: Topology) -> int:
    replicas = dist.get_world_size(topo.replicate_group) if topo.replicate_group else 1
    return topo.shard_world * replicas


def divisor(topo: Topology) -> int:
    """What a reduced gradient is divided by: the data-parallel world of its mesh, or of the
    model for a unit on its own mesh ([Note: per-unit meshes] in unit_mesh.py)."""
    return topo.divide_by if topo.divide_by is not None else data_parallel_world(topo)


def reduces_pieces(group: FlatGroup, topo: Topology, stats: CommStats) -> bool:
    """Can ``group``'s gradient be reduced straight from its per-parameter pieces (no flat
    copy)? When the transport can (comm decides), with no pre-division (fp16) and at least
    ``PIECES_MIN_BYTES`` (below that one message per parameter costs more than the copy)."""
    shard_group = topo.shard_group
    return (
        shard_group is not None
        and sends_from_pieces(shard_group, stats)
        and sum_scaling(group.reduce_dtype, divisor(topo))[0] == 1.0
        and wire_dtype(stats.reduce_wire, group.reduce_dtype) is None  # see reduce_on_wire
        and group.padded_numel * group.reduce_dtype.itemsize >= PIECES_MIN_BYTES
    )


def reduce_group(
    group: FlatGroup, grad: Grad, used: torch.Tensor, topo: Topology, stats: CommStats, timeout
) -> PendingReduce:
    """Start averaging one group's gradient over every data-parallel rank: a bucket of one
    (its padded flat gradient is already laid out in chunks), or one of the two shortcuts."""
    if topo.shard_group is None:  # no_shard: the flat gradient is the shard's gradient
        return _replicated(group, grad, used, topo, stats)
    if isinstance(grad, tuple):
        return _from_pieces(group, grad, used, topo, stats, timeout)
    return reduce_chunked(group, grad, used, topo, stats, timeout)


def reduce_chunked(
    group: FlatGroup, grad: torch.Tensor, used: torch.Tensor, topo: Topology, stats, timeout
) -> PendingReduce:
    """Start averaging ``group``'s padded flat gradient (viewed as ``[world, S]``: row ``r``
    is chunk ``r``) over every data-parallel rank: reduce-scatter SUM over the shard group,
    then the replicas, then the division."""
    wire = wire_dtype(stats.reduce_wire, grad.dtype)
    if wire is not None and stats.reduce_wire in QUANTIZED_WIRES:
        return reduce_quantized(group, grad, used, topo, stats, timeout)
    if wire is not None:
        return reduce_on_wire(group, grad, used, topo, stats, timeout, wire)
    pre, post = sum_scaling(grad.dtype, divisor(topo))
    out = torch.empty(group.shard_numel, dtype=grad.dtype, device=grad.device)  # rule 1
    with on_side_stream(topo.streams, "reduce"):  # see streams.py
        flat = divided(grad.view(-1), pre)
        work = reduce_scatter_sum(out, flat, topo.shard_group, stats, group.label)
        _then_replicas_and_divide(work, out, post, topo, stats, group.label, timeout)
    return PendingReduce(group, out, used, work)


def reduce_on_wire(
    group: FlatGroup, grad: torch.Tensor, used, topo: Topology, stats, timeout, wire: torch.dtype
) -> PendingReduce:
    """``reduce_chunked`` with ``fs.Comm(reduce="bf16")``: the fp32 flat gradient travels as
    ``wire`` (bf16) in an all-to-all over the shard group and each rank sums the ``world``
    chunks it receives in fp32 (``all_to_all_sum``): half the bytes, every addition in fp32.

    [Note: a narrow wire, a wide sum]
    A reduce-scatter sums along the way, in the dtype it carries: a bf16 one rounds every
    partial sum to bf16. Sent whole to its owner instead, a chunk is rounded once, on the way
    out; under bf16 compute it is bf16 already (the fp32 flat gradient holds bf16 values:
    lossless), so the result is the fp32 reduce-scatter's up to the order of the sum. Gloo's
    point-to-point ring (``gloo_p2p``) is bypassed: it sums as it passes chunks on, so in the
    wire dtype. ``hybrid_shard``'s all-reduce over the replicas then runs on the fp32 shard
    as before: it carries 1/world of the bytes, and in bf16 it would round partial sums again.
    The pre-division (fp16 only) never applies: the wire is used for an fp32 reduce_dtype."""
    post = sum_scaling(grad.dtype, divisor(topo))[1]
    world = group.padded_numel // group.shard_numel
    out = torch.empty(group.shard_numel, dtype=grad.dtype, device=grad.device)  # rule 1
    sent = torch.empty(group.padded_numel, dtype=wire, device=grad.device)  # rule 1
    received = torch.empty(world, group.shard_numel, dtype=wire, device=grad.device)  # rule 1
    with on_side_stream(topo.streams, "reduce"):  # see streams.py
        work = all_to_all_sum(
            out, grad.view(-1), sent, received.view(-1), topo.shard_group, stats, group.label
        )
        _then_replicas_and_divide(work, out, post, topo, stats, group.label, timeout)
    return PendingReduce(group, out, used, work)


def reduce_quantized(
    group: FlatGroup, grad: torch.Tensor, used, topo: Topology, stats: CommStats, timeout
) -> PendingReduce:
    """``reduce_on_wire`` with ``fs.Comm(reduce="int8"|"fp8")``: the flat gradient, viewed as
    ``[world, S]``, is quantized blockwise (with the rank's residual added first under error
    feedback, features/error_feedback.py), one all-to-all of the packed codes and scales hands
    rank ``r`` every rank's chunk ``r``, which it dequantizes and sums in fp32
    (``quantized_all_to_all_sum``). The summed shard stays fp32 whatever ``reduce_dtype``
    (the replicas' all-reduce and the division run on it in fp32, no fp16 pre-division)."""
    post = sum_scaling(torch.float32, divisor(topo))[1]
    world, row = group.padded_numel // group.shard_numel, group.shard_numel
    residuals = stats.residuals
    # fp32 whatever reduce_dtype: the sum of dequantized chunks cannot overflow (fp16) before
    # the division, and assign_grads casts into the fragments' dtype
    out = torch.empty(row, dtype=torch.float32, device=grad.device)  # rule 1
    row_bytes = quantize.packed_row_bytes(row)
    sent = torch.empty(world, row_bytes, dtype=torch.uint8, device=grad.device)  # rule 1
    received = torch.empty(world, row_bytes, dtype=torch.uint8, device=grad.device)  # rule 1
    residual = residuals.of(group) if residuals is not None else None
    with on_side_stream(topo.streams, "reduce"):  # see streams.py
        fmt = stats.reduce_wire
        codes, scales = quantize_with_feedback(grad.view(world, row), fmt, residual)
        quantize.pack(codes, scales, sent)
        work = quantized_all_to_all_sum(
            out, sent, received, fmt, topo.shard_group, stats, group.label, source=grad
        )
        _then_replicas_and_divide(work, out, post, topo, stats, group.label, timeout)
    return PendingReduce(group, out, used, work)


def _replicated(group: FlatGroup, grad: Grad, used, topo: Topology, stats) -> PendingReduce:
    assert isinstance(grad, torch.Tensor)
    label = group.label
    pre, post = sum_scaling(group.reduce_dtype, divisor(topo))
    # On the side stream only with a collective to wait for (the wait orders the compute
    # stream after it; see streams.py)
    streams = topo.streams if topo.replicate_group is not None else NO_STREAMS
    with on_side_stream(streams, "reduce"):
        grad_shard, work = divided(grad, pre), PendingWork(None, "none")
        if topo.replicate_group is not None:
            work = all_reduce_sum(grad_shard, topo.replicate_group, stats, label)
    work.add_then(lambda _: grad_shard.div_(post) if post != 1.0 else None)
    return PendingReduce(group, grad_shard, used, work)


def _from_pieces(
    group: FlatGroup, grads: tuple, used, topo: Topology, stats, timeout
) -> PendingReduce:
    """The per-parameter gradients of one group (``reduces_pieces``: pre == 1)."""
    label = group.label
    if group.chunk_spans is None:
        offsets = [(spec.offset, spec.numel) for spec in group.specs]
        group.chunk_spans = chunk_spans(offsets, group.shard_numel, group.world)
    post = sum_scaling(group.reduce_dtype, divisor(topo))[1]
    out = torch.empty(group.shard_numel, dtype=group.reduce_dtype, device=group.device)
    work = reduce_scatter_pieces_sum(
        out, grads, group.chunk_spans, group.padded_numel, topo.shard_group, stats, label
    )
    _then_replicas_and_divide(work, out, post, topo, stats, label, timeout)
    return PendingReduce(group, out, used, work)


def _then_replicas_and_divide(
    work: PendingWork, out: torch.Tensor, post: float, topo: Topology, stats, label: str, timeout
) -> None:
    """Once the reduce-scatter is done: (hybrid) sum ``out`` over the replicas (issued as
    soon as the transport allows, see ``then_issue``), then divide."""
    if topo.replicate_group is not None:
        replicate = topo.replicate_group
        then_issue(work, lambda: all_reduce_sum(out, replicate, stats, label), replicate, timeout)
    work.add_then(lambda _: out.div_(post) if post != 1.0 else None)


def divided(flat_grad: torch.Tensor, pre: float) -> torch.Tensor:
    """In place: the first half of the mean's division (fp16), see ``precision.sum_scaling``."""
    return flat_grad.div_(pre) if pre != 1.0 else flat_grad


# ---- building flat gradients ---------------------------------------------------------------
def flat_grad_from(group: FlatGroup, grads: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
    """One padded flat gradient from per-parameter grads; ``None`` (unused), alignment gaps
    and the tail padding become zeros."""
    pieces, position = [], 0
    for spec, grad in zip(group.specs, grads, strict=True):
        if spec.offset > position:
            pieces.append(_zeros(group, spec.offset - position))
        pieces.append(_zeros(group, spec.numel) if grad is None else grad.reshape(-1))
        position = spec.offset + spec.numel
    pieces.append(_zeros(group, group.padded_numel - position))
    dtype = group.reduce_dtype
    return torch.cat([p if p.dtype == dtype else p.to(dtype) for p in pieces])


def _zeros(group: FlatGroup, n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=group.reduce_dtype, device=group.device)


def zeros_flat_grad(group: FlatGroup) -> torch.Tensor:
    return _zeros(group, group.padded_numel)


# ---- assignment ----------------------------------------------------------------------------
def assign_grads(
    group: FlatGroup, grad_shard: torch.Tensor, used: list[bool], stats: CommStats
) -> None:
    """Give each used fragment its slice of ``grad_shard``; unused ones keep ``.grad``.
    ``used`` is host data (one flag per parameter): nothing here reads the device."""
    if group.offloaded:  # back to host memory (async; the end of backward waits for it)
        stats.record("offload_d2h", grad_shard)
        grad_shard = copy_to_host(grad_shard, group.storage)
    for spec, is_used in zip(group.specs, used, strict=True):
        if not is_used:
            continue
        frag = spec.fragment
        piece = grad_shard[spec.local_start : spec.local_end]
        piece = piece if piece.dtype == frag.dtype else piece.to(frag.dtype)
        if frag.grad is None:
            frag.grad = piece
        else:
            frag.grad.add_(piece)
