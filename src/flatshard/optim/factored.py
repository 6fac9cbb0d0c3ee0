"""Adafactor's factored second moment, computed from a fragment of a matrix.

A parameter of full shape ``(..., m, n)`` is ``B = numel / (m n)`` matrices of ``m x n``; its
flattened elements ``[start, end)`` (a fragment) cover rows ``start // n`` to
``ceil(end / n)`` of the ``B m`` rows, the first and last possibly in part. Padding the
fragment with zeros to whole rows makes it a ``rows x n`` block: its row sums are this rank's
part of the row statistics, its column sums (per matrix b) its part of the column statistics.
Summed over the shard ranks (a small all-reduce of ``B (m + n)`` numbers) they are exactly the
whole matrix's; the row/column factors themselves are tiny and kept whole on every rank, in
torch's shapes (``row_var``: ``(..., m, 1)``, ``col_var``: ``(..., 1, n)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rows:
    """Which rows of the ``B m`` rows of a parameter a fragment touches."""

    first: int  # the first row touched
    count: int  # rows touched (0 for an empty fragment)
    lead: int  # elements of the first row before the fragment starts
    m: int
    n: int
    batches: int  # B

    @staticmethod
    def of(shape: torch.Size, start: int, end: int) -> Rows:
        m, n = shape[-2], shape[-1]
        batches = shape.numel() // max(m * n, 1)
        if end <= start:
            return Rows(0, 0, 0, m, n, batches)
        first, last = start // n, (end + n - 1) // n
        return Rows(first, last - first, start - first * n, m, n, batches)

    def block(self, fragment: torch.Tensor) -> torch.Tensor:
        """The fragment, zero-padded to whole rows: ``count x n``."""
        out = fragment.new_zeros(self.count * self.n)
        out[self.lead : self.lead + fragment.numel()] = fragment
        return out.view(self.count, self.n)

    def unblock(self, block: torch.Tensor, numel: int) -> torch.Tensor:
        """The fragment's elements of a ``count x n`` block."""
        return block.reshape(-1)[self.lead : self.lead + numel]

    def batch_index(self, device: torch.device) -> torch.Tensor:
        """The matrix ``b`` of each touched row."""
        return torch.arange(self.first, self.first + self.count, device=device) // self.m


def partial_sums(grad_sq: torch.Tensor, rows: Rows) -> torch.Tensor:
    """This fragment's part of the row sums (``B m``) and the column sums (``B n``) of the
    squared gradient, concatenated."""
    out = grad_sq.new_zeros(rows.batches * (rows.m + rows.n))
    if rows.count:
        block = rows.block(grad_sq)
        out[rows.first : rows.first + rows.count] = block.sum(-1)
        cols = out[rows.batches * rows.m :].view(rows.batches, rows.n)
        cols.index_add_(0, rows.batch_index(block.device), block)
    return out


def update_factors(
    row_var: torch.Tensor, col_var: torch.Tensor, sums: torch.Tensor, rows: Rows, weight: float
) -> None:
    """``row_var``/``col_var`` move towards the whole matrix's row/column means of the squared
    gradient (``sums``: ``partial_sums`` summed over the shard ranks)."""
    split = rows.batches * rows.m
    row_var.lerp_(sums[:split].view(row_var.shape) / rows.n, weight)
    col_var.lerp_(sums[split:].view(col_var.shape) / rows.m, weight)


def factored_variance(
    row_var: torch.Tensor,
    col_var: torch.Tensor,
    row_mean: torch.Tensor,
    rows: Rows,
    numel: int,
) -> torch.Tensor:
    """The fragment's elements of torch's ``(row_var @ col_var) / row_mean``, ``row_mean``
    being ``max(mean(row_var), eps1)`` per matrix (``tp_stats.block_factors``: the three cut
    to the TP-local block the fragment and ``rows`` are of)."""
    if not rows.count:
        return row_var.new_empty(0)
    batch = rows.batch_index(row_var.device)
    r = row_var.reshape(-1)[rows.first : rows.first + rows.count, None]
    mean = row_mean.reshape(-1)[batch, None]
    block = (r * col_var.reshape(rows.batches, rows.n)[batch]).div_(mean)
    return rows.unblock(block, numel)
