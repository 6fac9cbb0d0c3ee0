"""How well a packing uses its slots: :func:`packing_report` -> :class:`PackingReport`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from flatshard.packing.binpack import _as_int_list, _check_capacity


@dataclass(frozen=True)
class PackingReport:
    """Summary of one packing (every bin is one row of ``capacity`` token slots)."""

    num_documents: int
    """Number of (index) entries over all bins."""
    num_bins: int
    """Bins (rows) used."""
    lower_bound_bins: int
    """``ceil(total tokens / capacity)``: no packing can use fewer bins."""
    real_tokens: int
    """Tokens that fit in their bin (what the model actually trains on)."""
    slots: int
    """``num_bins * capacity``."""
    efficiency: float
    """``real_tokens / slots`` (1.0 = no padding at all)."""
    mean_docs_per_bin: float
    """Average number of entries per bin."""
    max_docs_per_bin: int
    """Largest number of entries in one bin."""
    truncated_documents: int
    """Entries that do not (fully) fit because earlier entries of the same bin filled it."""
    truncated_tokens: int
    """Tokens lost to truncation (0 for any output of :func:`pack`)."""

    def __str__(self) -> str:
        return (
            f"{self.num_bins} bins (lower bound {self.lower_bound_bins}) for "
            f"{self.num_documents} docs, efficiency {self.efficiency:.2%}, "
            f"{self.mean_docs_per_bin:.1f} docs/bin (max {self.max_docs_per_bin}), "
            f"{self.truncated_documents} truncated ({self.truncated_tokens} tokens)"
        )


def packing_report(
    bins: Sequence[Sequence[int]], lengths: Sequence[int], capacity: int
) -> PackingReport:
    """Measure a packing: efficiency, bins vs the lower bound, documents per bin, truncation.

    ``bins`` hold indices into ``lengths`` (as returned by :func:`pack`; after
    ``split_long=True`` pass the chunk lengths). A bin whose lengths sum past ``capacity`` is
    counted as truncated at ``capacity``, entries laid out in bin order.
    """
    lens = _as_int_list(lengths)
    capacity = _check_capacity(capacity)
    real = truncated_docs = truncated_tokens = entries = max_docs = total = 0
    for b, members in enumerate(bins):
        used = 0
        for i in members:
            if not 0 <= i < len(lens):
                raise ValueError(
                    f"bins[{b}] holds index {i}, outside lengths (len {len(lens)}); pass the "
                    f"lengths the bins were packed from (chunk lengths after split_long=True)"
                )
            n = lens[i]
            total += n
            fits = max(0, min(n, capacity - used))
            if fits < n:
                truncated_docs += 1
                truncated_tokens += n - fits
            used += fits
        real += used
        entries += len(members)
        max_docs = max(max_docs, len(members))
    slots = len(bins) * capacity
    return PackingReport(
        num_documents=entries,
        num_bins=len(bins),
        lower_bound_bins=math.ceil(total / capacity),
        real_tokens=real,
        slots=slots,
        efficiency=real / slots if slots else 1.0,
        mean_docs_per_bin=entries / len(bins) if bins else 0.0,
        max_docs_per_bin=max_docs,
        truncated_documents=truncated_docs,
        truncated_tokens=truncated_tokens,
    )
