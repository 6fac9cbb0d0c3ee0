"""Adafactor's row and column statistics of a TP-local block, in the global matrix's terms.

With tensor parallelism (see [Note: whole-parameter optimizers]) a rank's fragment is part of
its TP-local block: the block of a parameter of global shape ``(..., M, N)`` that starts at
``origin`` and has the local shape ``(..., m, n)`` (``Shard(-2)``: some of the rows,
``Shard(-1)``: some of the columns, a batch dim: some of the matrices). ``factored.py``
computes the block's partial row and column sums as if the block were the parameter;
``to_global`` puts them at the block's global rows and columns, so that summed over dp and tp
they are the global matrix's sums. The other way, ``block_factors`` cuts the global factors
(``row_var``, ``col_var``, kept whole on every rank) down to the block's rows and columns, with
the row mean taken over the *global* rows, as torch's ``(row_var @ col_var) / mean(row_var)``
needs. Without TP the block is the parameter and both are the identity.
"""

from __future__ import annotations

import torch

from flatshard.optim.whole import WholeParam


def _narrowed(ids: torch.Tensor, dims: range, whole: WholeParam) -> torch.Tensor:
    """``ids`` (indexed like the global parameter's leading dims, and its last dim when
    ``ids`` has as many dims) narrowed to the block along ``dims``."""
    origin, local = whole.tp.origin, whole.shape
    for d in dims:
        ids = ids.narrow(d, origin[d], local[d])
    return ids


def row_ids(whole: WholeParam, device: torch.device) -> torch.Tensor:
    """The global index (of the ``B M`` rows) of each of the block's ``B_l m`` rows."""
    shape = whole.global_shape
    ids = torch.arange(shape[:-1].numel(), device=device).view(shape[:-1])
    return _narrowed(ids, range(len(shape) - 1), whole).reshape(-1)


def col_ids(whole: WholeParam, device: torch.device) -> torch.Tensor:
    """The global index (of the ``B N`` columns) of each of the block's ``B_l n`` columns."""
    shape = whole.global_shape
    ids = torch.arange(shape[:-2].numel() * shape[-1], device=device)
    ids = _narrowed(ids.view(*shape[:-2], shape[-1]), range(len(shape) - 2), whole)
    return ids.narrow(-1, whole.tp.origin[-1], whole.shape[-1]).reshape(-1)


def to_global(sums: torch.Tensor, whole: WholeParam, rows: int) -> torch.Tensor:
    """The block's ``[param_sq, its row sums, its column sums]`` (``rows`` = ``B_l m`` row
    sums) as ``[param_sq, B M row sums, B N column sums]``, zero where the block has none."""
    if whole.tp is None:
        return sums
    shape = whole.global_shape
    batches_rows = shape[:-1].numel()
    out = sums.new_zeros(1 + batches_rows + shape[:-2].numel() * shape[-1])
    out[:1] = sums[:1]
    out[1 : 1 + batches_rows].index_copy_(0, row_ids(whole, sums.device), sums[1 : 1 + rows])
    out[1 + batches_rows :].index_copy_(0, col_ids(whole, sums.device), sums[1 + rows :])
    return out


def block_factors(
    row_var: torch.Tensor, col_var: torch.Tensor, whole: WholeParam, eps1: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's rows of ``row_var``, its columns of ``col_var`` and, per block matrix, the
    clamped mean of ``row_var`` over the global matrix's rows: ``(..., m, 1)``,
    ``(..., 1, n)``, ``(..., 1, 1)``."""
    row_mean = row_var.mean(dim=-2, keepdim=True).clamp(min=eps1)
    if whole.tp is None:
        return row_var, col_var, row_mean
    ndim = len(whole.global_shape)
    row = _narrowed(row_var, range(ndim - 1), whole)
    col = _narrowed(col_var, range(ndim - 2), whole)
    col = col.narrow(-1, whole.tp.origin[-1], whole.shape[-1])
    return row, col, _narrowed(row_mean, range(ndim - 2), whole)
