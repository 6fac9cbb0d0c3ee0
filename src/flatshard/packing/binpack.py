"""Bin packing of variable-length documents into fixed-capacity rows.

``pack(lengths, capacity)`` returns bins of document indices: every index appears exactly once
and no bin holds more than ``capacity`` tokens. Results are deterministic: ties are broken by
document index, and the only randomness (``"shuffle_ff"``) comes from ``seed``.

Algorithms
----------
``"bfd"``         best-fit decreasing: longest first, each into the open bin it fills most tightly
                  (the packer of "Fewer Truncations Improve Language Modeling", Ding et al. 2024).
``"ffd"``         first-fit decreasing: longest first, each into the lowest-numbered bin it fits.
``"greedy"``      next fit in input order: fill the current bin, open a new one when it overflows.
``"shuffle_ff"``  first fit in a seeded random order.

Over-long documents
-------------------
A document longer than ``capacity`` cannot go into any bin, so ``pack`` raises unless
``split_long=True``. Then each such document is first cut into chunks of ``capacity`` tokens (the
last one shorter) by :func:`split_long_documents`, and **the bins hold indices into that chunk
list** rather than into ``lengths``. Because the chunk list has one entry per unsplit document, in
document order, the indices coincide with document indices exactly when nothing was split. Prefer
:func:`pack_chunks`, which returns the :class:`Chunk` objects themselves.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Sequence
from typing import NamedTuple

from flatshard.packing._trees import MaxTree, SortedKeys

ALGORITHMS = ("bfd", "ffd", "greedy", "shuffle_ff")


class Chunk(NamedTuple):
    """Tokens ``[start, end)`` of document ``doc``."""

    doc: int
    start: int
    end: int

    @property
    def length(self) -> int:
        """Number of tokens in the chunk."""
        return self.end - self.start


def _as_int_list(lengths: Sequence[int], name: str = "lengths") -> list[int]:
    """Lengths as a list of Python ints (numpy arrays / tensors accepted); TypeError otherwise."""
    raw = lengths.tolist() if hasattr(lengths, "tolist") else list(lengths)
    try:
        return [x.__index__() for x in raw]
    except (AttributeError, TypeError):
        bad = next(x for x in raw if not hasattr(x, "__index__") or isinstance(x, bool))
        raise TypeError(
            f"{name} must hold integer token counts, got {bad!r} ({type(bad).__name__}); "
            f"pass ints (e.g. len(tokens) of each document)"
        ) from None


def _check_capacity(capacity: int) -> int:
    if isinstance(capacity, bool) or not hasattr(capacity, "__index__"):
        raise TypeError(f"capacity must be an int (tokens per bin), got {capacity!r}")
    capacity = capacity.__index__()
    if capacity <= 0:
        raise ValueError(
            f"capacity={capacity} must be > 0: it is the number of tokens per bin "
            f"(use the training sequence length, e.g. capacity=1024)"
        )
    return capacity


def _validate(lengths: Sequence[int], capacity: int, split_long: bool) -> tuple[list[int], int]:
    lens = _as_int_list(lengths)
    capacity = _check_capacity(capacity)
    if lens and min(lens) < 0:
        i = min(range(len(lens)), key=lens.__getitem__)
        raise ValueError(
            f"lengths[{i}] = {lens[i]} is negative; lengths must be token counts >= 0 "
            f"(drop or fix that document)"
        )
    if not split_long and lens and max(lens) > capacity:
        i = next(j for j, n in enumerate(lens) if n > capacity)
        raise ValueError(
            f"lengths[{i}] = {lens[i]} exceeds capacity={capacity}: no bin can hold it; pass "
            f"split_long=True (or use pack_chunks) to split long documents into <= capacity "
            f"chunks, raise capacity, or truncate the document before packing"
        )
    return lens, capacity


def split_long_documents(lengths: Sequence[int], capacity: int) -> list[Chunk]:
    """Cut every document into chunks of at most ``capacity`` tokens, in document order.

    A document of length ``n <= capacity`` becomes the single chunk ``(i, 0, n)``; a longer one
    becomes ``ceil(n / capacity)`` chunks, all exactly ``capacity`` long except the last.

    >>> split_long_documents([3, 7], 4)
    [Chunk(doc=0, start=0, end=3), Chunk(doc=1, start=0, end=4), Chunk(doc=1, start=4, end=7)]
    """
    lens, capacity = _validate(lengths, capacity, split_long=True)
    chunks: list[Chunk] = []
    for i, n in enumerate(lens):
        if n <= capacity:
            chunks.append(Chunk(i, 0, n))
        else:
            chunks.extend(Chunk(i, s, min(s + capacity, n)) for s in range(0, n, capacity))
    return chunks


def _best_fit(order: list[int], lens: list[int], capacity: int) -> list[list[int]]:
    """Each item into the open bin with the least free space that still fits it."""
    bins: list[list[int]] = []
    stride = len(lens) + 1  # key = free * stride + bin_id: unique, ordered by (free, bin_id)
    free_space = SortedKeys()
    for i in order:
        need = lens[i]
        key = free_space.pop_ceiling(need * stride)
        if key is None:
            b, free = len(bins), capacity
            bins.append([])
        else:
            free, b = divmod(key, stride)
        bins[b].append(i)
        free_space.add((free - need) * stride + b)
    return bins


def _first_fit(order: list[int], lens: list[int], capacity: int) -> list[list[int]]:
    """Each item into the lowest-numbered bin with room for it."""
    bins: list[list[int]] = []
    tree = MaxTree(len(order), capacity)
    for i in order:
        b = tree.first_fit(lens[i])
        if b == len(bins):
            bins.append([])
        bins[b].append(i)
    return bins


def _next_fit(lens: list[int], capacity: int) -> list[list[int]]:
    """Fill the current bin in input order; open a new one when the next item overflows it."""
    bins: list[list[int]] = []
    used = capacity + 1  # forces a new bin for the first item
    for i, n in enumerate(lens):
        if used + n > capacity:
            bins.append([])
            used = 0
        bins[-1].append(i)
        used += n
    return bins


def _dispatch(lens: list[int], capacity: int, algorithm: str, seed: int) -> list[list[int]]:
    if seed != 0 and algorithm in ("bfd", "ffd", "greedy"):
        warnings.warn(
            f"seed={seed} has no effect with algorithm={algorithm!r} (only 'shuffle_ff' is "
            f"randomised); drop seed, or shuffle the returned bins yourself",
            stacklevel=3,
        )
    if algorithm in ("bfd", "ffd"):
        order = sorted(range(len(lens)), key=lambda i: -lens[i])  # stable: ties by index
        fit = _best_fit if algorithm == "bfd" else _first_fit
        return fit(order, lens, capacity)
    if algorithm == "greedy":
        return _next_fit(lens, capacity)
    if algorithm == "shuffle_ff":
        order = list(range(len(lens)))
        random.Random(seed).shuffle(order)
        return _first_fit(order, lens, capacity)
    raise ValueError(
        f"algorithm={algorithm!r} is not a packing algorithm; choose one of {ALGORITHMS} "
        f"(best-fit decreasing 'bfd' is the default and packs tightest)"
    )


def pack(
    lengths: Sequence[int],
    capacity: int,
    *,
    algorithm: str = "bfd",
    split_long: bool = False,
    seed: int = 0,
) -> list[list[int]]:
    """Pack documents of the given token ``lengths`` into bins of ``capacity`` tokens.

    Args:
        lengths: token count of each document (ints >= 0; a list, numpy array or tensor).
        capacity: tokens per bin, usually the training sequence length.
        algorithm: ``"bfd"`` (default), ``"ffd"``, ``"greedy"`` or ``"shuffle_ff"``.
        split_long: split documents longer than ``capacity`` into chunks first; the returned
            indices then refer to ``split_long_documents(lengths, capacity)`` (see module docs).
        seed: shuffling seed of ``"shuffle_ff"`` (ignored by the other algorithms).

    Returns:
        Bins of indices, in the order bins were opened; inside a bin, in placement order. Every
        index appears exactly once and every bin's lengths sum to at most ``capacity``.

    Raises:
        ValueError: a length exceeds ``capacity`` (without ``split_long``), a length is
            negative, ``capacity <= 0``, or ``algorithm`` is unknown.

    >>> pack([5, 3, 2, 4], 8)
    [[0, 1], [3, 2]]
    """
    lens, capacity = _validate(lengths, capacity, split_long)
    if split_long:
        lens = [c.length for c in split_long_documents(lens, capacity)]
    return _dispatch(lens, capacity, algorithm, seed)


def pack_chunks(
    lengths: Sequence[int],
    capacity: int,
    *,
    algorithm: str = "bfd",
    seed: int = 0,
) -> list[list[Chunk]]:
    """Like ``pack(..., split_long=True)`` but returns the :class:`Chunk` objects themselves.

    >>> pack_chunks([3, 7], 4)
    [[Chunk(doc=1, start=0, end=4)], [Chunk(doc=0, start=0, end=3)], [Chunk(doc=1, start=4, end=7)]]
    """
    chunks = split_long_documents(lengths, capacity)
    bins = _dispatch([c.length for c in chunks], _check_capacity(capacity), algorithm, seed)
    return [[chunks[i] for i in b] for b in bins]
