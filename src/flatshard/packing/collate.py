"""Packed batch format: ``collate`` turns documents into ``input_ids``/``labels``/``position_ids``
plus the ``cu_seqlens``/``max_seqlen`` pair of ``flash_attn_varlen_func``.

[Note: the label convention]
``labels`` are *already shifted*: ``labels[r, t]`` is the token the model must predict after
reading ``input_ids[r, t]``, i.e. ``input_ids[r, t + 1]`` when that token belongs to the same
document, and ``-100`` (ignored) otherwise -- at the last token of every document and on all
padding. A document of ``n`` tokens therefore contributes ``n`` inputs and ``n - 1`` targets; no
position ever predicts a token of another document. Compute the loss directly as
``cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)`` (see
:func:`flatshard.packing.packed_cross_entropy`) -- do *not* let a model shift them again (for
Hugging Face models pass them as ``shift_labels=`` or compute the loss outside the model).
If the model should learn to end documents, append the eos id to every document *before*
computing the packing lengths (the eos then is the target of the document's last real token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass(frozen=True)
class PackedBatch:
    """One packed micro-batch (``rows`` rows of ``T`` tokens)."""

    input_ids: torch.Tensor
    """``[rows, T]`` int64 token ids; padding is ``pad_id``."""
    labels: torch.Tensor
    """``[rows, T]`` int64, pre-shifted next-token targets, ``-100`` where there is none."""
    position_ids: torch.Tensor
    """``[rows, T]`` int64, restarting at 0 at every document (and every padding segment)."""
    cu_seqlens: torch.Tensor
    """``[num_segments + 1]`` int32 offsets into the flattened ``rows * T`` tokens; padding
    tails are segments of their own, so ``cu_seqlens[-1] == rows * T``."""
    max_seqlen: int
    """Longest segment (documents *and* padding segments), as flash-attention requires."""
    document_ids: torch.Tensor
    """``[rows, T]`` int64: index of the token's document in ``docs``, ``-1`` on padding."""

    @property
    def num_targets(self) -> int:
        """Number of target tokens (labels != -100) in this micro-batch."""
        return int((self.labels != IGNORE_INDEX).sum())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """Move every tensor to ``device`` (``cu_seqlens`` keeps int32)."""
        moved = {
            name: getattr(self, name).to(device, non_blocking=non_blocking)
            for name in ("input_ids", "labels", "position_ids", "cu_seqlens", "document_ids")
        }
        return PackedBatch(max_seqlen=self.max_seqlen, **moved)


def _layout_rows(lengths: list[int], seq_len: int, rows: int | None) -> list[list[int]]:
    """Next fit: documents fill a row in order; a document never straddles two rows."""
    layout: list[list[int]] = []
    used = seq_len
    for i, n in enumerate(lengths):
        if n == 0 or n > seq_len:
            raise ValueError(
                f"docs[{i}] has {n} tokens; every document needs 1..seq_len={seq_len} tokens "
                f"(drop empty documents; split long ones with pack(..., split_long=True))"
            )
        if used + n > seq_len:
            layout.append([])
            used = 0
        layout[-1].append(i)
        used += n
    if rows is not None:
        if len(layout) > rows:
            raise ValueError(
                f"docs need {len(layout)} rows of seq_len={seq_len} but rows={rows}; pass "
                f"fewer tokens (pack with capacity=seq_len, one bin per row) or raise rows"
            )
        layout.extend([] for _ in range(rows - len(layout)))
    return layout or [[]]


def collate(
    docs: Sequence[Sequence[int]],
    seq_len: int,
    *,
    pad_id: int,
    rows: int | None = None,
) -> PackedBatch:
    """Pack token-id documents into ``[rows, seq_len]`` tensors with document-aware targets.

    Documents are laid out in order, filling row after row (a document that does not fit in
    the rest of a row starts the next one; it is never split). With ``rows=None`` as many rows as
    needed are used (one row when the documents are one bin packed at ``capacity=seq_len``);
    with ``rows=R`` exactly ``R`` rows are returned (empty rows are all padding), which gives
    fixed shapes. Concatenating ``R`` bins of capacity ``seq_len`` always fits in ``rows=R``.

    Worked example (``seq_len=8, pad_id=0``)::

        docs         = [[5, 6, 7], [8, 9]]
        input_ids    = [[5, 6, 7,    8, 9,       0,    0,    0]]
        labels       = [[6, 7, -100, 9, -100, -100, -100, -100]]
        position_ids = [[0, 1, 2,    0, 1,       0,    1,    2]]
        cu_seqlens   = [0, 3, 5, 8]       # doc 0, doc 1, the padding tail
        max_seqlen   = 3
        document_ids = [[0, 0, 0, 1, 1, -1, -1, -1]]

    Every document of ``n`` tokens yields ``n - 1`` targets: the last token of a document has
    no target inside that document, so its label is ``-100`` (append eos to documents beforehand
    if the model should learn to stop). ``cu_seqlens``/``max_seqlen`` cover the flattened
    ``rows * seq_len`` tokens and can go straight to :func:`varlen_attention` or
    ``flash_attn_varlen_func``.
    """
    _check_seq_len(seq_len)
    lengths = [len(d) for d in docs]
    layout = _layout_rows(lengths, seq_len, rows)
    rows_out = _RowTensors.empty(len(layout), seq_len, pad_id)
    segments: list[int] = []
    for r, members in enumerate(layout):
        segments += _fill_row(rows_out, r, [(i, docs[i]) for i in members], seq_len)
    return PackedBatch(
        input_ids=rows_out.input_ids,
        labels=rows_out.labels,
        position_ids=rows_out.position_ids,
        cu_seqlens=_cu_seqlens(segments),
        max_seqlen=max(segments),
        document_ids=rows_out.document_ids,
    )


def _check_seq_len(seq_len: object) -> None:
    # bool is an int subclass: seq_len=True would silently mean one token per row
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise ValueError(f"seq_len={seq_len!r} must be a positive int (tokens per row)")


@dataclass(frozen=True)
class _RowTensors:
    """The four ``[rows, seq_len]`` tensors of a batch being filled, padding everywhere at first
    (``position_ids`` is written in full by :func:`_fill_row`, so it starts uninitialised)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor

    @classmethod
    def empty(cls, n_rows: int, seq_len: int, pad_id: int) -> _RowTensors:
        shape = (n_rows, seq_len)
        return cls(
            input_ids=torch.full(shape, pad_id, dtype=torch.long),
            labels=torch.full(shape, IGNORE_INDEX, dtype=torch.long),
            position_ids=torch.empty(shape, dtype=torch.long),
            document_ids=torch.full(shape, -1, dtype=torch.long),
        )


def _fill_row(
    out: _RowTensors, r: int, members: list[tuple[int, Sequence[int]]], seq_len: int
) -> list[int]:
    """Write documents ``members`` (``(index in docs, tokens)``, in order) into row ``r`` of
    ``out``; returns the row's segment lengths: one per document, then the padding tail."""
    segments: list[int] = []
    col = 0
    for i, doc in members:
        n = len(doc)
        tokens = torch.as_tensor(list(doc), dtype=torch.long)
        out.input_ids[r, col : col + n] = tokens
        out.labels[r, col : col + n - 1] = tokens[1:]  # the last token's target stays -100
        out.position_ids[r, col : col + n] = torch.arange(n)
        out.document_ids[r, col : col + n] = i
        segments.append(n)
        col += n
    if col < seq_len:  # the padding tail is a segment of its own (positions from 0 again)
        out.position_ids[r, col:] = torch.arange(seq_len - col)
        segments.append(seq_len - col)
    return segments


def _cu_seqlens(segments: list[int]) -> torch.Tensor:
    """int32 ``[0, s0, s0 + s1, ...]``, as ``flash_attn_varlen_func`` takes them."""
    cu_seqlens = torch.zeros(len(segments) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(segments, dtype=torch.int64), 0)
    return cu_seqlens
