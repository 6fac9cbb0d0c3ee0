"""Gradient bytes of the backward, reduction by reduction (``Unit.accumulate``/``start_reduce``,
``ShardedState.launch_reduce``), in the reduce dtype.

At a unit's post-backward its per-parameter gradients are cast to the reduce dtype if needed
and concatenated into a flat gradient, the reduction is launched with a new gradient shard as
its output, and the oldest reduction beyond ``max_inflight_reduces`` is waited for, which
frees its flat gradient. On Gloo's point-to-point ring a unit of at least
``PIECES_MIN_BYTES`` is reduced from its per-parameter gradients instead (``gloo_p2p.
reduce_scatter_pieces``), which stay alive in flight in place of the flat copy. A bucket of
coalesced blocks is one unit: reduced once, after its first block's (in forward order) backward,
always through the flat copy.
no_shard: the flat gradient is the gradient shard; nothing is in flight.
"""

from __future__ import annotations

from collections import deque

from flatshard.comm.gloo_p2p import MAX_P2P_WORLD
from flatshard.core.reduce import PIECES_MIN_BYTES
from flatshard.tools.estimate.spec import Layout
from flatshard.tools.estimate.units import Unit, Units

__all__ = ["Reductions", "larger", "largest_piece"]

Parts = dict[str, int]


class Reductions:
    """The reductions of one backward so far: ``gradients`` (shards of those launched) and
    ``flat_grads`` (flat gradients still in flight)."""

    def __init__(self, units: Units, layout: Layout) -> None:
        self.units, self.layout = units, layout
        self.width = layout.precision.flat
        self.shards = 0
        self.held = 0
        # Per reduction in flight: what it holds, and what its completion casts on top.
        self.in_flight: deque[tuple[int, int]] = deque()

    def between(self) -> Parts:
        """Between two post-backwards."""
        return {"gradients": self.shards, "flat_grads": self.held + self._flying()}

    def _flying(self) -> int:
        return sum(held for held, _ in self.in_flight)

    def _completing(self) -> int:
        """What the reductions that this launch waits for (the oldest beyond
        ``max_inflight_reduces``) allocate as they complete: rank 0's own pieces, cast."""
        extra = max(0, len(self.in_flight) + 1 - self.layout.max_inflight_reduces)
        return max((done for _, done in list(self.in_flight)[:extra]), default=0)

    def reduces_pieces(self, unit: Unit) -> bool:
        """Reduced straight from the per-parameter gradients (``reduce.reduces_pieces``):
        Gloo's point-to-point path; never a bucket (its parameters are small)."""
        lay = self.layout
        p2p = lay.backend == "gloo" and 2 <= lay.shard_world <= MAX_P2P_WORLD
        return p2p and unit.name != "bucket" and unit.pad * self.width >= PIECES_MIN_BYTES

    def post_backward(self, unit: Unit) -> Parts:
        """The peak of ``unit``'s post-backward (a block's, a bucket's, the root's, the tail's):
        the casts of its gradients live while the flat gradient is concatenated and are freed
        before the reduction's buffers are allocated, so the larger moment counts."""
        p = self.layout.precision
        casts = unit.numel * self.width if self.width != p.param else 0
        if self.layout.shard_world == 1:
            self.shards += unit.pad * self.width
            return {"gradients": self.shards, "flat_grads": casts}
        if self.reduces_pieces(unit):
            return self._pieces(unit)
        flat = unit.pad * self.width
        new = unit.shard * self.width
        before = self.held + self._flying() + flat
        parts = larger({"gradients": self.shards, "flat_grads": before + casts},
                        {"gradients": self.shards + new,
                         "flat_grads": before + self._completing()})  # fmt: skip
        self.shards += new
        self._launch(flat)
        return parts

    def _pieces(self, unit: Unit) -> Parts:
        """The ring from the pieces: its first step sends the pieces of the chunk after rank
        0's (the last one) cast to the reduce dtype, kept until the reduction is waited for,
        as are ``world - 2`` (at most 2) staging chunks for the running sums; when it
        completes, rank 0's own pieces are cast one at a time and added into the new shard."""
        p, world = self.layout.precision, self.layout.shard_world
        new = unit.shard * self.width
        cast = self.width != p.param
        sent = max(0, unit.numel - (world - 1) * unit.shard) * self.width if cast else 0
        own = largest_piece(unit.sizes, unit.shard) * self.width if cast else 0
        staging = min(world - 2, 2) * new
        parts = {"gradients": self.shards + new,
                 "flat_grads": self.held + self._flying() + sent + staging
                 + self._completing()}  # fmt: skip
        self.shards += new
        self._launch(unit.numel * p.param + sent + staging, own)  # the pieces stay alive
        return parts

    def _launch(self, nbytes: int, completing: int = 0) -> None:
        self.in_flight.append((nbytes, completing))
        while len(self.in_flight) > self.layout.max_inflight_reduces:
            self.in_flight.popleft()  # waited for: its flat gradient is freed


def larger(a: Parts, b: Parts) -> Parts:
    """The moment with more bytes of two."""
    return a if sum(a.values()) > sum(b.values()) else b


def largest_piece(sizes: tuple[int, ...], shard: int) -> int:
    """Largest piece of one parameter among the first ``shard`` flat elements (rank 0's)."""
    best, offset = 0, 0
    for n in sizes:
        best = max(best, min(offset + n, shard) - min(offset, shard))
        offset += n
    return best
