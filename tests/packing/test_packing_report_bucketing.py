"""packing_report on hand-checked cases; bucket_by_length invariants."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flatshard.packing import bucket_by_length, packing_report, padding_efficiency


def test_report_counts_slots_bounds_and_docs_per_bin():
    lengths = [6, 2, 5, 3, 4]
    report = packing_report([[0, 1], [2, 3], [4]], lengths, 8)
    assert report.num_bins == 3 and report.num_documents == 5
    assert report.lower_bound_bins == 3  # ceil(20 / 8)
    assert report.real_tokens == 20 and report.slots == 24
    assert report.efficiency == pytest.approx(20 / 24)
    assert report.mean_docs_per_bin == pytest.approx(5 / 3)
    assert report.max_docs_per_bin == 2
    assert report.truncated_documents == 0 and report.truncated_tokens == 0


def test_report_counts_truncation_of_overfull_bins():
    report = packing_report([[0, 1, 2]], [5, 4, 3], 8)  # 5 fit, then 3 of 4, then none of 3
    assert report.real_tokens == 8
    assert report.truncated_documents == 2 and report.truncated_tokens == 4
    assert report.efficiency == 1.0


def test_report_rejects_foreign_indices():
    with pytest.raises(ValueError, match=r"bins\[0\] holds index 7"):
        packing_report([[7]], [1, 2], 4)


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 50), max_size=60),
    batch_size=st.integers(1, 8),
    seed=st.integers(0, 3),
)
def test_bucket_by_batch_size(lengths, batch_size, seed):
    batches = bucket_by_length(lengths, batch_size=batch_size, seed=seed)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len(b) <= batch_size for b in batches)
    assert sum(len(b) < batch_size for b in batches) <= 1
    assert batches == bucket_by_length(lengths, batch_size=batch_size, seed=seed)


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(0, 50), max_size=60), budget=st.integers(50, 400))
def test_bucket_by_tokens_respects_budget(lengths, budget):
    batches = bucket_by_length(lengths, batch_tokens=budget, shuffle=False)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= budget for b in batches)
    # sorted order: every batch's lengths are >= the previous batch's
    maxes = [max(lengths[i] for i in b) for b in batches]
    mins = [min(lengths[i] for i in b) for b in batches]
    assert all(lo >= hi for hi, lo in zip(maxes[:-1], mins[1:], strict=True))


def test_bucketing_pads_less_than_random_batches():
    rng = random.Random(0)
    lengths = [rng.randint(1, 500) for _ in range(400)]
    bucketed = bucket_by_length(lengths, batch_size=8)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    unsorted = [order[i : i + 8] for i in range(0, len(order), 8)]
    assert padding_efficiency(bucketed, lengths) > 0.95
    assert padding_efficiency(bucketed, lengths) > padding_efficiency(unsorted, lengths) + 0.2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "exactly one"),
        ({"batch_size": 2, "batch_tokens": 8}, "exactly one"),
        ({"batch_size": 0}, "batch_size=0"),
        ({"batch_tokens": 3}, r"lengths\[0\] = 5 exceeds batch_tokens=3"),
    ],
)
def test_bucket_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bucket_by_length([5, 1], **kwargs)
