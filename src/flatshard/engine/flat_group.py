"""One flat group: parameters of one unit that share a dtype and ``requires_grad``.

Layout: the group's parameters (each tensor once) are laid end to end in one flat buffer, padded
to a multiple of the shard-group size ``W``; rank ``r`` owns elements ``[r*S, (r+1)*S)`` with
``S = padded / W``. What the optimizer sees per original parameter is a persistent 1-D
``nn.Parameter`` *fragment*: a view of this rank's shard covering the part of that parameter it
owns (possibly empty). So stock ``torch.optim`` optimizers step on the shard in place and their
state is sharded for free.

[Note: full buffer lifetime]
``full`` is one tensor object per group for the whole life of the model. Its storage is
allocated before a gather and resized to zero bytes when the unit reshards. Autograd saves views
of ``full`` (e.g. ``linear`` saves its weight); those views keep pointing at the same storage,
so the regather before backward makes them valid again without re-running forward. Gathers write
through ``full.data`` so that autograd's version counter is not bumped: the data written back is
bit-identical to what forward saw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..comm import gloo_p2p
from ..comm.collectives import (
    CommStats,
    PendingWork,
    all_gather_into,
    all_reduce_sum,
    reduce_scatter_pieces_sum,
    reduce_scatter_sum,
)
from ..offload import CPUOffload, pin_if_useful, storage_device
from ..precision import MixedPrecision, compute_dtype, reduce_dtype, sum_scaling
from .gather_pool import GatheredBytes, GatherPool
from .layout import FlatLayout, align_elements
from .mesh import Topology


@dataclass
class ParamSpec:
    """Where one original parameter lives in its group's flat layout."""

    shape: torch.Size
    offset: int  # start in the padded flat buffer
    numel: int
    local_start: int  # the fragment is shard[local_start:local_end]
    local_end: int
    fragment: nn.Parameter


PIECES_MIN_BYTES = 1 << 20  # see FlatGroup.reduces_pieces


def then_replicas(
    work: PendingWork, grad_shard: torch.Tensor, topo: Topology, stats: CommStats, label: str
) -> None:
    """hybrid_shard: once the reduce-scatter is done, sum ``grad_shard`` over the replicas."""
    if topo.replicate_group is not None:
        replicate = topo.replicate_group
        work.add_then(lambda t: all_reduce_sum(grad_shard, replicate, stats, label).wait(t))


def divided(flat_grad: torch.Tensor, pre: float) -> torch.Tensor:
    """In place: the first half of the mean's division (fp16), see ``precision.sum_scaling``."""
    return flat_grad.div_(pre) if pre != 1.0 else flat_grad


def data_parallel_world(topo: Topology) -> int:
    replicas = dist.get_world_size(topo.replicate_group) if topo.replicate_group else 1
    return topo.shard_world * replicas


class FlatGroup:
    """A flat buffer of same-dtype parameters, sharded over ``world`` ranks."""

    def __init__(
        self,
        params: list[nn.Parameter],
        *,
        rank: int,
        world: int,
        device: torch.device,
        mixed_precision: MixedPrecision | None = None,
        offload: CPUOffload | None = None,
        label: str = "",
    ) -> None:
        self.label = label  # names the group in debug-mode mismatch reports
        self.dtype = params[0].dtype  # of the shard: what the optimizer steps on
        self.compute_dtype = compute_dtype(self.dtype, mixed_precision)  # of the full buffer
        self.reduce_dtype = reduce_dtype(self.dtype, mixed_precision)  # of the communication
        self.requires_grad = params[0].requires_grad
        self.device = device  # where the gathered buffer lives and compute happens
        self.offloaded = offload is not None and offload.params
        self.storage = storage_device(device, offload)  # where the shard lives
        self.world = world
        self.rank = rank
        # Every parameter starts on a 16-byte boundary of the full buffer (in both the stored and
        # the compute dtype): GPU kernels (cuBLAS, inductor) pick slower paths for odd offsets.
        align = align_elements(self.dtype, self.compute_dtype)
        self.layout = FlatLayout([p.shape for p in params], world=world, rank=rank, align=align)
        self.padded_numel = self.layout.padded_numel
        self.shard_numel = self.layout.shard_numel
        self.shard = torch.zeros(self.shard_numel, dtype=self.dtype, device=self.storage)
        self.shard = pin_if_useful(self.shard, device)
        self.specs = self._fragments(params)
        # Not sharded (no_shard) in the stored dtype: the shard is the full buffer, nothing to
        # gather or free. With a cast (mixed precision) the full buffer is its own tensor.
        self.replicated = world == 1 and self.compute_dtype == self.dtype and self.storage == device
        self.full = (
            self.shard
            if self.replicated
            else torch.empty(self.padded_numel, dtype=self.compute_dtype, device=device)
        )
        self._full_bytes = self.full.untyped_storage().nbytes()
        self._private = self.full
        self.pool: GatherPool | None = None  # set when gathers may borrow pooled buffers
        self.account: GatheredBytes | None = None  # flatshard's count of gathered bytes
        self._borrowed: torch.Tensor | None = None  # the pooled buffer ``full`` views, if any
        self.keep_private = False  # saved views of this step hold the private storage
        self._chunk_spans: list[list[gloo_p2p.Span]] | None = None  # see _reduce_scatter
        self._views: list[torch.Tensor] = []  # full_views of ``_views_of`` (a ``full``)
        self._views_of: torch.Tensor | None = None
        self.shared = None  # a bucket_storage.SharedStorage holding ``_private``, if coalesced
        self.chunk_plan: list | None = None  # see buckets.write_chunked
        self.free_full()

    def _fragments(self, params: list[nn.Parameter]) -> list[ParamSpec]:
        """Copy this rank's part of each parameter into the shard; one fragment view each."""
        specs = []
        for param, place in zip(params, self.layout.places, strict=True):
            lo, hi = place.local_start, place.local_end
            if hi > lo and param.device.type != "meta":
                start, end = self.layout.fragment_range(place)
                self.shard[lo:hi].copy_(param.detach().reshape(-1)[start:end])
            fragment = nn.Parameter(self.shard[lo:hi], requires_grad=param.requires_grad)
            specs.append(ParamSpec(place.shape, place.offset, place.numel, lo, hi, fragment))
        return specs

    def fragment_range(self, spec: ParamSpec) -> tuple[int, int]:
        """The elements ``[start, end)`` of the flattened parameter that ``spec.fragment`` holds."""
        start = self.layout.shard_start + spec.local_start - spec.offset
        return start, start + (spec.local_end - spec.local_start)

    # ---- full buffer -------------------------------------------------------------------------
    # ``full`` is either this group's private buffer (``_private``, storage resized to zero when
    # released; see [Note: full buffer lifetime]) or a view of a buffer borrowed from ``pool``
    # (see [Note: gather buffers and saved tensors] in gather_pool.py).
    @property
    def is_allocated(self) -> bool:
        if self.shared is not None:
            return self.shared.holds(self)
        return self._borrowed is not None or self._private.untyped_storage().nbytes() > 0

    def share_storage(self, shared, view: torch.Tensor) -> None:
        """Use ``view`` of a bucket's storage as the private buffer (see buckets.py): the
        storage is allocated while any member holds it and freed when none does."""
        self.shared, self.pool = shared, None
        self._private = self.full = view
        self._views, self._views_of = [], None

    @property
    def is_pooled(self) -> bool:
        """Gathered into a pooled buffer right now."""
        return self._borrowed is not None

    def allocate_full(self) -> None:
        if self.is_allocated:
            return
        if self.pool is not None and not self.keep_private:
            self._borrowed = self.pool.acquire(
                self.padded_numel, self.compute_dtype, self.device, owner=self
            )
            self.full = self._borrowed[: self.padded_numel]
        else:
            self._resize_private(self._full_bytes)

    def free_full(self) -> None:
        if self._borrowed is not None:
            self.pool.release(self._borrowed)  # type: ignore[union-attr]
            self._borrowed, self.full = None, self._private
            self._views, self._views_of = [], None  # they would keep the pooled buffer alive
        elif not self.replicated:
            self._resize_private(0)

    def _resize_private(self, nbytes: int) -> None:
        if self.shared is not None:
            self.shared.hold(self) if nbytes else self.shared.release(self)
            return
        storage = self._private.untyped_storage()
        if self.account is not None:
            self.account.change(nbytes - storage.nbytes())
        storage.resize_(nbytes)

    def move_to_private(self) -> None:
        """Copy a pooled gather into the private buffer (whose storage saved views may keep)
        and gather there until this backward is over (``keep_private``)."""
        if self._borrowed is None:
            return
        self.keep_private = True
        self._resize_private(self._full_bytes)
        self._private.data.copy_(self.full.data)
        self.pool.release(self._borrowed)  # type: ignore[union-attr]
        self._borrowed, self.full = None, self._private
        self._views, self._views_of = [], None

    def gather(self, group: dist.ProcessGroup | None, stats: CommStats) -> PendingWork:
        """Async: all-gather every rank's shard straight into ``full`` (no copy-in, no copy-out).
        This rank's own chunk is written in place first (cast to the compute dtype, so half the
        bytes travel under mixed precision) and sent from there: no separate send buffer."""
        self.allocate_full()
        if group is None:
            return all_gather_into(self.full.data, self.send_shard(stats), group, stats, self.label)
        own = self.full.data.view(self.world, self.shard_numel)[self.rank]
        self.write_send_shard(own, stats)
        return all_gather_into(self.full.data, own, group, stats, self.label)

    def write_send_shard(self, dest: torch.Tensor, stats: CommStats) -> None:
        """Write this rank's shard as a gather sends it into ``dest`` (one copy, casting to the
        compute dtype and moving an offloaded shard to the device on the way)."""
        if self.offloaded:
            stats.record("offload_h2d", self.shard)
        dest.copy_(self.shard, non_blocking=self.offloaded)

    def send_shard(self, stats: CommStats) -> torch.Tensor:
        """This rank's shard as a gather sends it: on the device, in the compute dtype."""
        send = self.shard
        if self.offloaded:  # to the device (a no-op copy on a CPU-only run)
            stats.record("offload_h2d", send)
            send = send.to(self.device, non_blocking=True)
        if send.dtype != self.compute_dtype:
            send = send.to(self.compute_dtype)
        return send

    def full_views(self) -> list[torch.Tensor]:
        """Full-shape views of ``full``, one per parameter (no autograd edge): fresh tensor
        objects each call (autograd attaches a ``grad_fn`` to what ``UnitViews`` returns), as
        aliases of views built once per buffer (an alias costs a sixth of a slice + view)."""
        if self._views_of is not self.full:
            data = self.full.data
            self._views = [data[s.offset : s.offset + s.numel].view(s.shape) for s in self.specs]
            self._views_of = self.full
        return [v.detach() for v in self._views]

    # ---- gradients ---------------------------------------------------------------------------
    def flat_grad_from(self, grads: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        """One padded flat gradient from per-parameter grads; ``None`` (unused), alignment gaps
        and the tail padding become zeros."""
        pieces, position = [], 0
        for spec, grad in zip(self.specs, grads, strict=True):
            if spec.offset > position:
                pieces.append(self._zeros(spec.offset - position))
            pieces.append(self._zeros(spec.numel) if grad is None else grad.reshape(-1))
            position = spec.offset + spec.numel
        pieces.append(self._zeros(self.padded_numel - position))
        dtype = self.reduce_dtype
        return torch.cat([p if p.dtype == dtype else p.to(dtype) for p in pieces])

    def _zeros(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=self.reduce_dtype, device=self.device)

    def zeros_flat_grad(self) -> torch.Tensor:
        return torch.zeros(self.padded_numel, dtype=self.reduce_dtype, device=self.device)

    def reduces_pieces(self, topo: Topology, p2p: bool) -> bool:
        """Can a gradient be reduced straight from its per-parameter pieces (no flat copy)?
        Gloo point-to-point groups, no pre-division (fp16), at least ``PIECES_MIN_BYTES`` (below
        that one message per parameter costs more than the copy saves)."""
        group = topo.shard_group
        return (
            group is not None
            and gloo_p2p.p2p_enabled(group, p2p)
            and sum_scaling(self.reduce_dtype, data_parallel_world(topo))[0] == 1.0
            and self.padded_numel * self.reduce_dtype.itemsize >= PIECES_MIN_BYTES
        )

    def start_reduce(
        self,
        flat_grad: torch.Tensor | tuple[torch.Tensor | None, ...],
        topo: Topology,
        stats: CommStats,
    ) -> tuple[torch.Tensor, PendingWork]:
        """Start averaging ``flat_grad`` over every data-parallel rank; returns (this rank's
        gradient shard, work). ``flat_grad`` may also be the per-parameter gradients when
        :meth:`reduces_pieces`. Sharded: reduce-scatter (SUM) over the shard group, then (hybrid)
        an all-reduce of the shard over the replicate group once the first has completed; the
        mean's division is split around the sum (see ``precision.sum_scaling``)."""
        pre, post = sum_scaling(self.reduce_dtype, data_parallel_world(topo))
        if topo.shard_group is None:  # no_shard: the flat gradient is the shard's gradient
            assert isinstance(flat_grad, torch.Tensor)
            grad_shard, work = divided(flat_grad, pre), PendingWork(None, "none")
            if topo.replicate_group is not None:
                work = all_reduce_sum(grad_shard, topo.replicate_group, stats, self.label)
        else:
            grad_shard = torch.empty(self.shard_numel, dtype=self.reduce_dtype, device=self.device)
            work = self._reduce_scatter(grad_shard, flat_grad, pre, topo.shard_group, stats)
            then_replicas(work, grad_shard, topo, stats, self.label)
        work.add_then(lambda _: grad_shard.div_(post) if post != 1.0 else None)
        return grad_shard, work

    def _reduce_scatter(
        self,
        out: torch.Tensor,
        flat_grad: torch.Tensor | tuple[torch.Tensor | None, ...],
        pre: float,
        group: dist.ProcessGroup,
        stats: CommStats,
    ) -> PendingWork:
        if isinstance(flat_grad, tuple):  # per-parameter gradients (``reduces_pieces``: pre == 1)
            spans = self._chunk_spans
            if spans is None:
                offsets = [(spec.offset, spec.numel) for spec in self.specs]
                spans = self._chunk_spans = gloo_p2p.chunk_spans(
                    offsets, self.shard_numel, self.world
                )
            return reduce_scatter_pieces_sum(
                out, flat_grad, spans, self.padded_numel, group, stats, self.label
            )
        return reduce_scatter_sum(out, divided(flat_grad, pre), group, stats, self.label)

    def assign_grads(self, grad_shard: torch.Tensor, used: torch.Tensor, stats: CommStats) -> None:
        """Give each used fragment its slice of ``grad_shard``; unused ones keep ``.grad``."""
        if self.offloaded:  # back to host memory, synchronously: the optimizer reads it next
            stats.record("offload_d2h", grad_shard)
            grad_shard = grad_shard.to(self.storage)
        for spec, is_used in zip(self.specs, used.tolist(), strict=True):
            if not is_used:
                continue
            frag = spec.fragment
            piece = grad_shard[spec.local_start : spec.local_end]
            piece = piece if piece.dtype == frag.dtype else piece.to(frag.dtype)
            if frag.grad is None:
                frag.grad = piece
            else:
                frag.grad.add_(piece)
