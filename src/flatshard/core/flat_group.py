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
from torch import nn

from flatshard.core.layout import FlatLayout, align_elements
from flatshard.features.float8 import float8_group, float8_views
from flatshard.features.gather_pool import GatheredBytes, GatherPool
from flatshard.offload import CPUOffload, pin_if_useful, storage_device
from flatshard.parallel.tensor import TPSpec, local_of, spec_of
from flatshard.precision import MixedPrecision, compute_dtype, reduce_dtype


@dataclass
class ParamSpec:
    """Where one original parameter lives in its group's flat layout."""

    shape: torch.Size
    offset: int  # start in the padded flat buffer
    numel: int
    local_start: int  # the fragment is shard[local_start:local_end]
    local_end: int
    fragment: nn.Parameter


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
        # Tensor-parallel parameters are laid out by their TP-local tensors (see [Note:
        # tensor-parallel parameters] in parallel/tensor.py).
        self.tp: list[TPSpec | None] = [spec_of(p) for p in params]
        self.has_tp = any(s is not None for s in self.tp)
        self.requires_grad = params[0].requires_grad
        params = [local_of(p) for p in params]
        self.dtype = params[0].dtype  # of the shard: what the optimizer steps on
        self.compute_dtype = compute_dtype(self.dtype, mixed_precision)  # of the full buffer
        # torchao float8 weights gather as float8 bytes (see [Note: float8 all-gather]).
        self.float8 = float8_group(params, self.compute_dtype)
        if self.float8 is not None:
            self.compute_dtype = torch.uint8
        self.reduce_dtype = reduce_dtype(self.dtype, mixed_precision)  # of the communication
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
        self.chunk_spans: list[list[tuple]] | None = None  # see reduce._from_pieces
        self._views: list[torch.Tensor] = []  # full_views of ``_views_of`` (a ``full``)
        self._views_of: torch.Tensor | None = None
        self.allocations = 0  # fresh full buffers so far (a pooled one made for it included)
        self.free_full()

    def _fragments(self, params: list[nn.Parameter]) -> list[ParamSpec]:
        """Copy this rank's part of each parameter into the shard; one fragment view each."""
        specs = []
        for param, place in zip(params, self.layout.places, strict=True):
            lo, hi = place.local_start, place.local_end
            if hi > lo and param.device.type != "meta":
                start, end = self.layout.fragment_range(place)
                self.shard[lo:hi].copy_(param.detach().reshape(-1)[start:end])
            fragment = nn.Parameter(self.shard[lo:hi], requires_grad=self.requires_grad)
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
        return self._borrowed is not None or self._private.untyped_storage().nbytes() > 0

    @property
    def is_pooled(self) -> bool:
        """Gathered into a pooled buffer right now."""
        return self._borrowed is not None

    def allocate_full(self) -> None:
        if self.is_allocated:
            return
        if self.pool is not None and not self.keep_private:
            made = self.pool.allocations
            self._borrowed = self.pool.acquire(
                self.padded_numel, self.compute_dtype, self.device, owner=self
            )
            self.full = self._borrowed[: self.padded_numel]
            self.allocations += self.pool.allocations - made
        else:
            self.allocations += 1
            self._resize_private(self._full_bytes)

    def free_full(self) -> None:
        if self._borrowed is not None:
            self.pool.release(self._borrowed)  # type: ignore[union-attr]
            self._borrowed, self.full = None, self._private
            self._views, self._views_of = [], None  # they would keep the pooled buffer alive
        elif not self.replicated:
            self._resize_private(0)

    def _resize_private(self, nbytes: int) -> None:
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

    def full_views(self) -> list[torch.Tensor]:
        """Full-shape views of ``full``, one per parameter (no autograd edge): fresh tensor
        objects each call (autograd attaches a ``grad_fn`` to what ``UnitViews`` returns), as
        aliases of views built once per buffer (an alias costs a sixth of a slice + view)."""
        if self.float8 is not None:
            return float8_views(self)
        if self._views_of is not self.full:
            data = self.full.data
            self._views = [data[s.offset : s.offset + s.numel].view(s.shape) for s in self.specs]
            self._views_of = self.full
        return [v.detach() for v in self._views]
