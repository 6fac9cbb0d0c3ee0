"""The flat layout of one group: where each parameter lies in the padded buffer, what a rank owns.

Pure arithmetic on shapes (no tensors): the parameters are laid end to end, each starting on
an ``align``-element boundary (16 bytes: GPU kernels pick slower paths for odd offsets; the
gaps hold zeros), and the end is padded to a multiple of the shard-group size ``W`` (at least
one element per rank). Rank ``r`` owns elements ``[r*S, (r+1)*S)`` with ``S = padded / W``.
``FlatGroup`` allocates its buffers from this; the estimator sizes units with ``padded_numel``.
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


def padded_numel(total: int, world: int) -> int:
    """A flat buffer of ``total`` elements padded to a multiple of ``world`` (>= one each)."""
    return max(world, math.ceil(total / world) * world)


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
        self.padded_numel = padded_numel(offsets[-1], world)
        self.shard_numel = self.padded_numel // world
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        self.places: list[Place] = []
        for shape, offset, n in zip(shapes, offsets, numels, strict=False):
            start = max(offset, lo)
            end = max(start, min(offset + n, hi))
            self.places.append(Place(torch.Size(shape), offset, n, start - lo, end - lo))

    @property
    def shard_start(self) -> int:
        """Where this rank's shard starts in the padded buffer."""
        return self.rank * self.shard_numel

    def fragment_range(self, place: Place) -> tuple[int, int]:
        """The elements ``[start, end)`` of the flattened parameter this rank holds."""
        start = self.shard_start + place.local_start - place.offset
        return start, start + (place.local_end - place.local_start)
