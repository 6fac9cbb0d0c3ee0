"""Collectives as free functions over a process group, with counters and bounded waits.

Every collective flatshard issues goes through this file, so that
- each one is counted (``CommStats``: tests pin the number of collectives per step, benchmarks
  report the bytes moved), and
- every wait has a timeout: a peer that died or took another code path turns into an error that
  names this rank and the operation, never into a silent hang.
"""

from __future__ import annotations

import datetime
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from flatshard.comm import gloo_p2p, quantize, watchdog
from flatshard.comm.debug import OpChecker

# torch 2.13 renamed the tensor collectives (the old names warn); torch 2.6 has only the old.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommStats:
    """Per-model counts of issued collectives (``op -> count``) and bytes this rank sent; in
    debug mode (``FLATSHARD_DEBUG=1``) also the cross-rank check that precedes each one."""

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    checker: OpChecker | None = None  # debug mode: the check before every collective
    p2p: bool = True  # may Gloo groups use the point-to-point algorithms (gloo_p2p)?
    reduce_wire: str | None = None  # fs.Comm(reduce=...): how gradients travel (wire_dtype)
    gather_wire: str | None = None  # fs.Comm(gather=...): how parameters travel
    residuals: Any = None  # fs.Comm(error_feedback=True): features/error_feedback.Residuals

    def record(
        self,
        op: str,
        tensor: torch.Tensor,
        group: dist.ProcessGroup | None = None,
        label: str = "",
    ) -> None:
        if self.checker is not None and group is not None:
            self.checker.check(group, op, tensor, label)
        self.calls[op] += 1
        self.bytes[op] += tensor.numel() * tensor.element_size()

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()


@dataclass
class PendingWork:
    """An async collective in flight, plus the tensors that must outlive it. Off Gloo it is
    registered with the watchdog when made (``comm/watchdog.py``, [Note: the collective
    watchdog]): ``label`` and ``group`` are what its report names."""

    work: dist.Work | None
    op: str
    keep_alive: tuple[torch.Tensor, ...] = ()
    then: Callable[[datetime.timedelta], None] | None = None  # runs once it has completed
    label: str = ""  # the unit or bucket it serves, e.g. "unit 3 (Block) group 0"
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        # Off Gloo the wait below takes no timeout, so the watchdog bounds the collective
        # instead, from its issue on (it may complete long after its wait on NCCL).
        if self.work is not None and dist.is_initialized() and not _bounded_wait(self.work):
            watchdog.watch(self.work, self.op, self.label, self.group)

    def wait(self, timeout: datetime.timedelta) -> None:
        if self.work is None:
            self._run_then(timeout)
            return
        bounded = _bounded_wait(self.work)
        if not bounded:  # a hang the watchdog reported since is raised here, once
            watchdog.check(timeout)
        try:
            if bounded:
                self.work.wait(timeout)
            else:  # see _bounded_wait: the watchdog and the group's own timeout catch a hang
                self.work.wait()
        except RuntimeError as err:
            rank = dist.get_rank() if dist.is_initialized() else 0  # world: names this process
            raise RuntimeError(
                f"[flatshard rank {rank}] {self.op} did not complete within {timeout}: a peer "
                f"rank may have died or issued a different collective. Cause: {err}"
            ) from err
        self.work = None
        self.keep_alive = ()
        self._run_then(timeout)

    def add_then(self, fn: Callable[[datetime.timedelta], None]) -> None:
        """Run ``fn`` after the collective (and after any step already chained)."""
        first = self.then
        self.then = fn if first is None else (lambda t: (first(t), fn(t))[-1])

    def _run_then(self, timeout: datetime.timedelta) -> None:
        if self.then is not None:
            then, self.then = self.then, None
            then(timeout)


def _bounded_wait(work: object) -> bool:
    """Pass flatshard's timeout to ``work.wait``? Only on Gloo (the default group's backend,
    which flatshard's groups are made from; gloo_p2p's works are Gloo by construction), whose
    wait blocks the host anyway. On ProcessGroupNCCL any timeout makes the host poll until the
    collective has *completed* on the GPU (no CPU run-ahead), while ``wait()`` only makes the
    current stream wait for it. Hang detection there is flatshard's watchdog thread (bound:
    ``FLATSHARD_TIMEOUT_S``, but before the group's own timeout; see ``watchdog.py``), then
    the process group's own timeout and watchdog (``init_process_group(timeout=)``)."""
    return isinstance(work, gloo_p2p.P2PWork) or dist.get_backend() == "gloo"


def waits_on_host(group: dist.ProcessGroup) -> bool:
    """Does waiting on a collective of ``group`` block the host until it completes (Gloo),
    rather than only ordering the current device stream after it (NCCL)?"""
    return gloo_p2p.described(group)[0] == "gloo"


def then_issue(
    work: PendingWork,
    issue: Callable[[], PendingWork],
    group: dist.ProcessGroup,
    timeout: datetime.timedelta,
) -> None:
    """Issue the collective ``issue()`` (on ``group``) once ``work`` has completed; ``work``
    becomes the handle of both. Where a wait blocks the host (Gloo) that happens at
    ``work``'s wait, so that nothing blocks now. On a device backend (NCCL) it happens now:
    the wait only makes the current stream wait for ``work``, so the second collective is
    queued right behind the first and overlaps whatever the host issues next (hybrid_shard's
    all-reduce across replicas was exposed when issued at the wait).

    That wait orders only the current stream (a side stream, when called inside
    ``on_side_stream``), so ``work``'s buffers are held on until the handle's own wait, which
    the caller makes on the stream that allocated them (rule 4 of [Note: streams and buffer
    lifetimes] in core/streams.py): dropped here, the flat gradient went back to the caching
    allocator, which could hand it to compute-stream kernels while the reduce-scatter still
    read it."""
    if waits_on_host(group):
        work.add_then(lambda t: issue().wait(t))
        return
    held = work.keep_alive
    work.wait(timeout)
    follow = issue()
    work.work, work.op, work.then = follow.work, follow.op, follow.then
    work.keep_alive = (*held, *follow.keep_alive)


def all_gather_into(
    out: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats,
    label: str = "",
) -> PendingWork:
    """Async: gather every rank's ``shard`` into ``out`` (``out.numel() == world * shard.numel()``).
    ``shard`` may be this rank's own chunk of ``out`` (in place, as FSDP2 gathers: no copy of it).
    ``group=None`` is a group of one: nothing to gather (callers alias ``out`` and ``shard``)."""
    if group is None:
        if out.data_ptr() != shard.data_ptr():
            out.copy_(shard)
        return PendingWork(None, "all_gather")
    stats.record("all_gather", shard, group, label)
    if gloo_p2p.p2p_enabled(group, stats.p2p):
        return PendingWork(gloo_p2p.all_gather(out, shard, group), "all_gather", (out, shard))
    # Gloo's own all-gather is not documented to allow in place. Gloo only: any other backend
    # (NCCL; on the host the strict_async test backend) runs the device path, in place.
    if waits_on_host(group) and _aliases(out, shard):
        shard = shard.clone()
    work = _all_gather_tensor(out, shard, group=group, async_op=True)
    return PendingWork(work, "all_gather", (out, shard), label=label, group=group)


def _aliases(out: torch.Tensor, shard: torch.Tensor) -> bool:
    start = out.data_ptr()
    return start <= shard.data_ptr() < start + out.numel() * out.element_size()


def reduce_scatter_sum(
    out: torch.Tensor,
    full: torch.Tensor,
    group: dist.ProcessGroup,
    stats: CommStats,
    label: str = "",
) -> PendingWork:
    """Async: ``out`` = this rank's chunk of the sum over ranks of ``full``.

    On Gloo with up to 8 ranks it is a ring of point-to-point sends (``gloo_p2p``: 2-3x faster
    than Gloo's collectives). Larger Gloo groups use an all-reduce of ``full`` plus a copy of this
    rank's chunk: Gloo's reduce_scatter is measured 1.5x slower than its all_reduce of the same
    buffer (6.8 MiB: 22.7 vs 14.3 ms at world 2, 32.9 vs 22.2 ms at world 3 on the 2-core CI box),
    although it moves fewer bytes. ``full`` is scratch (the flat gradient) either way.
    """
    stats.record("reduce_scatter", full, group, label)
    if gloo_p2p.p2p_enabled(group, stats.p2p):
        work = gloo_p2p.reduce_scatter_sum(out, full, group)
        return PendingWork(work, "reduce_scatter", (out, full))
    if waits_on_host(group):
        work = dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group, async_op=True)
        chunk = full.view(-1, out.numel())[dist.get_rank(group)]
        return PendingWork(work, "reduce_scatter", (out, full), then=lambda _: out.copy_(chunk))
    work = _reduce_scatter_tensor(out, full, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return PendingWork(work, "reduce_scatter", (out, full), label=label, group=group)


def all_to_all_sum(
    out: torch.Tensor,
    full: torch.Tensor,
    wire: torch.Tensor,
    received: torch.Tensor,
    group: dist.ProcessGroup,
    stats: CommStats,
    label: str = "",
) -> PendingWork:
    """Async: like :func:`reduce_scatter_sum`, with ``full`` sent in ``wire``'s (narrower)
    dtype and summed in ``out``'s where it arrives: ``full`` is cast into ``wire``, an
    all-to-all hands rank ``r`` every rank's chunk ``r`` (``received``, ``[world, S]`` in
    the wire dtype), and the sum over those rows, in ``out``'s dtype, fills ``out`` once the
    wait has returned. ``wire`` and ``received`` are allocated by the caller (on the compute
    stream: rule 1 of [Note: streams and buffer lifetimes] in core/streams.py), and the sum
    runs at the wait: on the stream that waits (rule 3). On a point-to-point Gloo group the
    chunks go straight to their owners (``_p2p_all_to_all``), not through ``gloo_p2p``'s
    ring, which sums as it passes chunks on (so in the wire dtype)."""
    wire.copy_(full)
    stats.record("all_to_all", wire, group, label)  # half an fp32 reduce-scatter's bytes
    work = _all_to_all(received, wire, group, stats)
    rows = received.view(-1, out.numel())

    def sum_rows(_) -> None:  # in rank order; 1.5-4x faster on CPU than torch.sum(dtype=)
        out.copy_(rows[0])
        for row in rows[1:]:
            out.add_(row)  # fp32 += bf16: the addition is fp32

    pending = PendingWork(work, "all_to_all", (out, full, wire, received), label=label, group=group)
    pending.add_then(sum_rows)
    return pending


def quantized_all_to_all_sum(
    out: torch.Tensor,
    sent: torch.Tensor,
    received: torch.Tensor,
    fmt: str,
    group: dist.ProcessGroup,
    stats: CommStats,
    label: str = "",
    source: torch.Tensor | None = None,
) -> PendingWork:
    """Async: ``all_to_all_sum`` for blockwise-quantized rows. ``sent`` (uint8 ``[world, B]``,
    row ``d`` for rank ``d``: ``quantize.pack``'s codes then scales) goes out in one
    all-to-all; once the wait has returned, the ``world`` rows received are unpacked,
    dequantized and summed in fp32, in rank order, into ``out`` (``[S]``). The caller
    quantizes (with error feedback: core/reduce.py) and allocates both byte buffers;
    ``source``, the gradient it quantized (on the side stream), is held until the wait
    (rule 2 of [Note: streams and buffer lifetimes] in core/streams.py)."""
    stats.record("all_to_all", sent, group, label)  # codes + scales: what the wire carries
    work = _all_to_all(received, sent, group, stats)

    def sum_rows(_) -> None:  # ``out`` is fp32 (core/reduce.reduce_quantized)
        codes, scales = quantize.unpack(received, fmt, out.numel())
        rows = quantize.dequantize(codes, scales)
        out.copy_(rows[0])
        for row in rows[1:]:
            out.add_(row)

    kept = (out, sent, received, source)
    pending = PendingWork(work, "all_to_all", kept, label=label, group=group)
    pending.add_then(sum_rows)
    return pending


def _all_to_all(received: torch.Tensor, sent: torch.Tensor, group, stats: CommStats):
    """Async ``all_to_all_single``; on a point-to-point Gloo group, the chunks straight to
    their owners (``_p2p_all_to_all``)."""
    if gloo_p2p.p2p_enabled(group, stats.p2p):
        return _p2p_all_to_all(received, sent, group)
    return dist.all_to_all_single(received, sent, group=group, async_op=True)


A2A_TAG = 0x46532000  # beside gloo_p2p's tags ([Note: p2p message matching] there)


def _p2p_all_to_all(
    received: torch.Tensor, sent: torch.Tensor, group: dist.ProcessGroup
) -> gloo_p2p.P2PWork:
    """Gloo point-to-point all-to-all: chunk ``d`` of ``sent`` to rank ``d``, rank ``s``'s
    chunk ``r`` into row ``s`` of ``received``; all posted at once, as ``gloo_p2p.all_gather``
    (measured faster than Gloo's ``alltoall`` at worlds 2-8: docs/mixed_precision.md)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    outgoing, incoming = sent.view(world, -1), received.view(world, -1)
    works = []
    for offset in range(1, world):  # pair up as rank+k / rank-k so sends and receives interleave
        dst, src = (rank + offset) % world, (rank - offset) % world
        peer_dst, peer_src = dist.get_global_rank(group, dst), dist.get_global_rank(group, src)
        works.append(dist.isend(outgoing[dst], peer_dst, group=group, tag=A2A_TAG))
        works.append(dist.irecv(incoming[src], peer_src, group=group, tag=A2A_TAG))
    incoming[rank].copy_(outgoing[rank])
    return gloo_p2p.P2PWork(works, [])


def sends_from_pieces(group: dist.ProcessGroup, stats: CommStats) -> bool:
    """Can a reduce-scatter over ``group`` send a gradient from its per-parameter pieces
    (:func:`reduce_scatter_pieces_sum`)? Only the Gloo point-to-point transport can."""
    return gloo_p2p.p2p_enabled(group, stats.p2p)


def reduce_scatter_pieces_sum(
    out: torch.Tensor,
    grads: tuple[torch.Tensor | None, ...],
    spans: list[list[gloo_p2p.Span]],
    flat_numel: int,
    group: dist.ProcessGroup,
    stats: CommStats,
    label: str = "",
) -> PendingWork:
    """Async: like :func:`reduce_scatter_sum` of the flat gradient that the per-parameter
    ``grads`` would form (``flat_numel`` elements laid out as ``spans``), without forming it
    (Gloo point-to-point only: ``gloo_p2p.reduce_scatter_pieces``)."""
    descriptor = out.new_empty(()).expand(flat_numel)  # counts/checks as the flat tensor would
    stats.record("reduce_scatter", descriptor, group, label)
    work = gloo_p2p.reduce_scatter_pieces(out, grads, spans, group)
    return PendingWork(work, "reduce_scatter", (out,))


def all_reduce_sum(
    tensor: torch.Tensor, group: dist.ProcessGroup, stats: CommStats, label: str = ""
) -> PendingWork:
    """Async in-place sum over ``group``."""
    stats.record("all_reduce", tensor, group, label)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return PendingWork(work, "all_reduce", (tensor,), label=label, group=group)


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats,
    *,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    name: str = "all_reduce",
) -> None:
    """Blocking in-place all-reduce (small tensors: flags, norms, counts); None: a group of one."""
    if group is None:
        return
    stats.record(name, tensor, group, name)
    dist.all_reduce(tensor, op=op, group=group)


def broadcast(
    tensor: torch.Tensor, src_rank: int, group: dist.ProcessGroup, stats: CommStats
) -> None:
    """Blocking broadcast from the group rank ``src_rank``."""
    stats.record("broadcast", tensor, group, "broadcast")
    if dist.get_world_size(group) > 1:
        dist.broadcast(tensor, group=group, group_src=src_rank)
