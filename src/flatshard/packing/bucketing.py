"""Length bucketing for *padded* batches: the alternative to packing when a model needs
one document per row.

Sorting by length before cutting batches keeps the padding of each batch small; the batches
are then shuffled (seeded) so training does not see lengths in order.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Sequence

from flatshard.packing.binpack import _as_int_list


def _check_positive(value: int | None, name: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"{name}={value!r} must be a positive int (or None)")


def bucket_by_length(
    lengths: Sequence[int],
    *,
    batch_size: int | None = None,
    batch_tokens: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
) -> list[list[int]]:
    """Group document indices into padded batches of similar length.

    Exactly one budget must be given:

    * ``batch_size``: every batch holds ``batch_size`` documents (the last may hold fewer);
    * ``batch_tokens``: a batch grows while ``len(batch) * longest_in_batch <= batch_tokens``,
      i.e. the padded ``[rows, longest]`` tensor stays within the token budget.

    Indices are sorted by length (ties by index), cut into batches, and with ``shuffle`` the
    batch order is permuted with ``random.Random(seed)``; the result is deterministic.

    Raises:
        ValueError: neither or both budgets given, a budget <= 0, a negative length, or (with
            ``batch_tokens``) a document longer than ``batch_tokens``.

    >>> bucket_by_length([5, 1, 4, 2], batch_tokens=8, shuffle=False)
    [[1, 3], [2], [0]]
    """
    if (batch_size is None) == (batch_tokens is None):
        raise ValueError(
            f"bucket_by_length needs exactly one of batch_size / batch_tokens, got "
            f"batch_size={batch_size!r}, batch_tokens={batch_tokens!r}"
        )
    _check_positive(batch_size, "batch_size")
    _check_positive(batch_tokens, "batch_tokens")
    lens = _as_int_list(lengths)
    for i, n in enumerate(lens):
        if n < 0:
            raise ValueError(f"lengths[{i}] = {n} is negative; lengths are token counts >= 0")
    order = sorted(range(len(lens)), key=lens.__getitem__)
    if batch_size is not None:
        batches = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
    else:
        batches = _cut_by_tokens(order, lens, batch_tokens)
    if shuffle:
        random.Random(seed).shuffle(batches)
    elif seed != 0:
        warnings.warn(f"seed={seed} has no effect with shuffle=False", stacklevel=2)
    return batches


def _cut_by_tokens(order: list[int], lens: list[int], budget: int) -> list[list[int]]:
    """Cut ascending-length ``order`` so that rows * longest <= budget in every batch."""
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        n = lens[i]
        if n > budget:
            raise ValueError(
                f"lengths[{i}] = {n} exceeds batch_tokens={budget}: it cannot fit even alone; "
                f"raise batch_tokens or split/truncate that document"
            )
        if current and (len(current) + 1) * n > budget:  # n is the new longest (ascending)
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def padding_efficiency(batches: Sequence[Sequence[int]], lengths: Sequence[int]) -> float:
    """Real tokens / padded slots when each batch is padded to its longest document."""
    lens = _as_int_list(lengths)
    real = sum(lens[i] for b in batches for i in b)
    slots = sum(len(b) * max((lens[i] for i in b), default=0) for b in batches)
    return real / slots if slots else 1.0
