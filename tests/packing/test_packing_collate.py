"""collate: the worked example, and the label/position/cu_seqlens invariants on random docs."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flatshard.packing import collate, pack


def test_docstring_worked_example():
    batch = collate([[5, 6, 7], [8, 9]], 8, pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert batch.labels.tolist() == [[6, 7, -100, 9, -100, -100, -100, -100]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert batch.cu_seqlens.tolist() == [0, 3, 5, 8]
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.max_seqlen == 3
    assert batch.document_ids.tolist() == [[0, 0, 0, 1, 1, -1, -1, -1]]
    assert batch.num_targets == 3


@st.composite
def docs_and_seq_len(draw):
    seq_len = draw(st.integers(1, 24))
    docs = draw(st.lists(st.lists(st.integers(0, 99), min_size=1, max_size=seq_len), max_size=12))
    return docs, seq_len


@settings(max_examples=80, deadline=None)
@given(data=docs_and_seq_len())
def test_invariants(data):
    docs, seq_len = data
    batch = collate(docs, seq_len, pad_id=-1)
    ids, labels = batch.input_ids.flatten(), batch.labels.flatten()
    doc_ids, pos = batch.document_ids.flatten(), batch.position_ids.flatten()
    assert batch.input_ids.shape[1] == seq_len
    for i, doc in enumerate(docs):  # every document appears whole, in one row, positions 0..n-1
        where = (batch.document_ids == i).nonzero()
        assert where[:, 0].unique().numel() == 1
        assert ids[doc_ids == i].tolist() == doc
        assert pos[doc_ids == i].tolist() == list(range(len(doc)))
    for t in range(ids.numel()):  # a label is the next token of the *same* document, or -100
        same_doc_next = t + 1 < ids.numel() and doc_ids[t] >= 0 and doc_ids[t + 1] == doc_ids[t]
        assert labels[t].item() == (ids[t + 1].item() if same_doc_next else -100)
    assert batch.num_targets == sum(len(d) - 1 for d in docs)
    cu = batch.cu_seqlens.tolist()
    assert cu[0] == 0 and cu[-1] == ids.numel()
    segments = [b - a for a, b in itertools.pairwise(cu)]
    assert all(n > 0 for n in segments) and batch.max_seqlen == max(segments)
    for a, b in itertools.pairwise(cu):  # each segment is one document or one padding run
        assert doc_ids[a:b].unique().numel() == 1
        assert pos[a:b].tolist() == list(range(b - a))


def test_one_bin_is_one_row_and_rows_pads_to_fixed_shape():
    lengths = [5, 3, 7, 2, 6, 1, 4]
    docs = [list(range(n)) for n in lengths]
    bins = pack(lengths, 8)
    for b in bins:
        assert collate([docs[i] for i in b], 8, pad_id=0).input_ids.shape == (1, 8)
    flat = [docs[i] for b in bins for i in b]
    batch = collate(flat, 8, pad_id=0, rows=len(bins) + 1)
    assert batch.input_ids.shape == (len(bins) + 1, 8)
    assert (batch.labels[-1] == -100).all() and (batch.document_ids[-1] == -1).all()
    assert batch.cu_seqlens[-1].item() == (len(bins) + 1) * 8


def test_empty_micro_batch_is_all_padding():
    batch = collate([], 4, pad_id=9, rows=2)
    assert batch.input_ids.tolist() == [[9] * 4] * 2
    assert batch.num_targets == 0
    assert batch.cu_seqlens.tolist() == [0, 4, 8]


@pytest.mark.parametrize(
    ("docs", "kwargs", "match"),
    [
        ([[1] * 9], {}, r"docs\[0\] has 9 tokens"),
        ([[1], []], {}, r"docs\[1\] has 0 tokens"),
        ([[1] * 5, [2] * 5], {"rows": 1}, "need 2 rows"),
    ],
)
def test_errors(docs, kwargs, match):
    with pytest.raises(ValueError, match=match):
        collate(docs, 8, pad_id=0, **kwargs)


def test_to_moves_and_keeps_dtypes():
    batch = collate([[1, 2]], 4, pad_id=0).to("cpu")
    assert batch.cu_seqlens.dtype == torch.int32 and batch.labels.dtype == torch.long
