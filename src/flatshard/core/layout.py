"""The flat layout of one group: where each parameter lies in the padded buffer, what a rank owns.

Pure arithmetic on shapes (no tensors): the parameters are laid end to end, each starting on
an ``align``-element boundary (16 bytes: GPU kernels pick slower paths for odd offsets; the
gaps hold zeros), and the end is padded to a multiple of ``W * align`` (``W``: the shard-group
size; at least ``align`` elements per rank), so every rank's chunk starts on a 16-byte
boundary as well. Rank ``r`` owns elements ``[r*S, (r+1)*S)`` with ``S = padded / W``.
``FlatGroup`` allocates its buffers from this; the estimator sizes units with ``padded_numel``.
All chunk arithmetic lives here: which part of which parameter falls in rank ``r``'s chunk
(``overlap``) serves this rank's places, the per-chunk spans of a reduction from
per-parameter pieces (``chunk_spans``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ALIGN_BYTES = 16


def align_elements(*dtypes: torch.dtype) -> int:
    """Elements per 16 bytes in the narrowest of ``dtypes`` (the stored and the compute one)."""
    return max(1, ALIGN_BYTES // min(d.itemsize for d in dtypes))


def aligned_offsets(numels: list[int], align: int) -> list[int]:
    """Start of each parameter in the flat buffer, then the end of the last one."""
    offsets, position = [], 0
    for n in numels:
        position = -(-position // align) * align
        offsets.append(position)
        position += n
    return [*offsets, position]


def padded_numel(total: int, world: int, align: int = 1) -> int:
    """A flat buffer of ``total`` elements padded so that each of the ``world`` chunks holds a
    multiple of ``align`` elements (at least ``align``): every rank's chunk then starts on a
    16-byte boundary too (NCCL's fast paths, foreach kernels, a bucket's rows)."""
    unit = world * align
    return max(unit, math.ceil(total / unit) * unit)


def overlap(offset: int, numel: int, lo: int, hi: int) -> tuple[int, int]:
    """The part ``[start, end)`` of the flat range ``[offset, offset + numel)`` that lies in
    ``[lo, hi)``; ``start == end`` when none does (then ``start`` may lie past ``hi``: an
    empty fragment's place, kept as it always was since checkpoints record fragment ranges)."""
    start = max(offset, lo)
    return start, max(start, min(offset + numel, hi))


Span = tuple[int, int, int, int]  # (offset in the chunk, length, parameter index, offset in it)


def chunk_spans(offsets: list[tuple[int, int]], chunk_numel: int, world: int) -> list[list[Span]]:
    """For each chunk of the flat layout, the parts of parameters (``offsets``: (flat offset,
    numel) per parameter) that fall in it. Alignment gaps and tail padding belong to no span."""
    spans: list[list[Span]] = []
    for c in range(world):
        lo, hi = c * chunk_numel, (c + 1) * chunk_numel
        mine = []
        for index, (offset, numel) in enumerate(offsets):
            start, end = overlap(offset, numel, lo, hi)
            if end > start:
                mine.append((start - lo, end - start, index, start - offset))
        spans.append(mine)
    return spans


@dataclass(frozen=True)
class Place:
    """Where one parameter lives: in the padded buffer, and in this rank's shard."""

    shape: torch.Size
    offset: int  # start in the padded flat buffer
    numel: int
    local_start: int  # this rank's part is shard[local_start:local_end] (possibly empty)
    local_end: int


class FlatLayout:
    """The layout of parameters of the given shapes over ``world`` ranks, seen from ``rank``."""

    def __init__(self, shapes: list[torch.Size], *, world: int, rank: int, align: int) -> None:
        numels = [math.prod(s) for s in shapes]
        offsets = aligned_offsets(numels, align)
        self.world, self.rank = world, rank
        self.padded_numel = padded_numel(offsets[-1], world, align)
        self.shard_numel = self.padded_numel // world
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        self.places: list[Place] = []
        for shape, offset, n in zip(shapes, offsets, numels, strict=False):
            start, end = overlap(offset, n, lo, hi)
            self.places.append(Place(torch.Size(shape), offset, n, start - lo, end - lo))

    @property
    def shard_start(self) -> int:
        """Where this rank's shard starts in the padded buffer."""
        return self.rank * self.shard_numel

    def fragment_range(self, place: Place) -> tuple[int, int]:
        """The elements ``[start, end)`` of the flattened parameter this rank holds."""
        start = self.shard_start + place.local_start - place.offset
        return start, start + (place.local_end - place.local_start)
