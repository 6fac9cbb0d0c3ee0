"""Bin packers: invariants (hypothesis), agreement with naive reference packers, errors,
and efficiency on the embedded corpus."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flatshard.packing import (
    ALGORITHMS,
    Chunk,
    pack,
    pack_chunks,
    packing_report,
    split_long_documents,
)

CAPACITY = st.integers(min_value=1, max_value=64)


@st.composite
def lengths_and_capacity(draw, max_size: int = 60):
    capacity = draw(CAPACITY)
    lengths = draw(st.lists(st.integers(0, capacity), max_size=max_size))
    return lengths, capacity


def _algo(algorithm, seed):
    """pack kwargs; only shuffle_ff takes a seed (others warn that it has no effect)."""
    return {"algorithm": algorithm, "seed": seed if algorithm == "shuffle_ff" else 0}


def _loads(bins, lengths):
    return [sum(lengths[i] for i in b) for b in bins]


# --- naive O(n * bins) references with the documented tie-breaking -------------------------------


def _naive_any_fit(order, lengths, capacity, best: bool):
    bins, free = [], []
    for i in order:
        fits = [b for b, f in enumerate(free) if f >= lengths[i]]
        if not fits:
            bins.append([])
            free.append(capacity)
            fits = [len(bins) - 1]
        b = min(fits, key=lambda b: (free[b], b)) if best else fits[0]
        bins[b].append(i)
        free[b] -= lengths[i]
    return bins


def _naive(lengths, capacity, algorithm, seed=0):
    decreasing = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if algorithm == "bfd":
        return _naive_any_fit(decreasing, lengths, capacity, best=True)
    if algorithm == "ffd":
        return _naive_any_fit(decreasing, lengths, capacity, best=False)
    if algorithm == "shuffle_ff":
        order = list(range(len(lengths)))
        random.Random(seed).shuffle(order)
        return _naive_any_fit(order, lengths, capacity, best=False)
    bins, used = [], capacity + 1
    for i, n in enumerate(lengths):
        if used + n > capacity:
            bins.append([])
            used = 0
        bins[-1].append(i)
        used += n
    return bins


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@settings(max_examples=60, deadline=None)
@given(data=lengths_and_capacity(), seed=st.integers(0, 5))
def test_every_index_once_and_no_bin_over_capacity(algorithm, data, seed):
    lengths, capacity = data
    bins = pack(lengths, capacity, **_algo(algorithm, seed))
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(load <= capacity for load in _loads(bins, lengths))
    assert all(b for b in bins), "no empty bins"
    assert bins == pack(lengths, capacity, **_algo(algorithm, seed)), "deterministic"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@settings(max_examples=60, deadline=None)
@given(data=lengths_and_capacity(), seed=st.integers(0, 5))
def test_matches_naive_reference(algorithm, data, seed):
    lengths, capacity = data
    assert pack(lengths, capacity, **_algo(algorithm, seed)) == _naive(
        lengths, capacity, algorithm, seed
    )


@pytest.mark.parametrize("algorithm", ["bfd", "ffd", "shuffle_ff"])
@settings(max_examples=40, deadline=None)
@given(data=lengths_and_capacity())
def test_any_fit_leaves_at_most_one_bin_half_empty(algorithm, data):
    lengths, capacity = data
    loads = _loads(pack(lengths, capacity, algorithm=algorithm), lengths)
    assert sum(2 * load <= capacity for load in loads) <= 1


@settings(max_examples=40, deadline=None)
@given(data=lengths_and_capacity())
def test_next_fit_consecutive_bins_overflow(data):
    lengths, capacity = data
    loads = _loads(pack(lengths, capacity, algorithm="greedy"), lengths)
    assert all(a + b > capacity for a, b in itertools.pairwise(loads))


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 300), max_size=30),
    capacity=st.integers(1, 64),
    algorithm=st.sampled_from(ALGORITHMS),
)
def test_split_long_covers_every_token_once(lengths, capacity, algorithm):
    chunks = split_long_documents(lengths, capacity)
    assert all(0 < c.length <= capacity or c.length == lengths[c.doc] == 0 for c in chunks)
    for doc, n in enumerate(lengths):
        spans = [(c.start, c.end) for c in chunks if c.doc == doc]
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), "contiguous"
    bins = pack(lengths, capacity, algorithm=algorithm, split_long=True)
    assert sorted(i for b in bins for i in b) == list(range(len(chunks)))
    assert all(sum(chunks[i].length for i in b) <= capacity for b in bins)
    resolved = pack_chunks(lengths, capacity, algorithm=algorithm)
    assert resolved == [[chunks[i] for i in b] for b in bins]


def test_split_long_indices_are_document_indices_when_nothing_is_split():
    lengths = [3, 8, 1, 5]
    assert pack(lengths, 8, split_long=True) == pack(lengths, 8)
    assert split_long_documents([10], 4) == [Chunk(0, 0, 4), Chunk(0, 4, 8), Chunk(0, 8, 10)]


def test_too_long_raises_naming_index_length_capacity_and_fix():
    with pytest.raises(ValueError) as err:
        pack([3, 9, 2], 8)
    message = str(err.value)
    for needle in ("lengths[1]", "9", "capacity=8", "split_long=True"):
        assert needle in message


@pytest.mark.parametrize(
    ("kwargs", "needles"),
    [
        ({"lengths": [1, -2], "capacity": 4}, ("lengths[1]", "-2")),
        ({"lengths": [1], "capacity": 0}, ("capacity=0", "> 0")),
        ({"lengths": [1], "capacity": 4, "algorithm": "best"}, ("'best'", "bfd")),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, needles):
    with pytest.raises(ValueError) as err:
        pack(**kwargs)
    assert all(n in str(err.value) for n in needles)


def test_non_integer_length_is_a_type_error():
    with pytest.raises(TypeError, match="integer"):
        pack([1.5, 2], 4)


def test_accepts_numpy_and_tensor_lengths():
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    lengths = [5, 3, 2, 4, 7]
    expected = pack(lengths, 8)
    assert pack(np.array(lengths), 8) == expected
    assert pack(torch.tensor(lengths), 8) == expected


def _corpus_lengths() -> list[int]:
    """Byte-token lengths (+1 eos) of the embedded corpus; pydoc topics if it is unavailable."""
    try:
        from flatshard.data.corpus import embedded_documents

        texts = embedded_documents()
    except ImportError:
        from pydoc_data.topics import topics

        texts = list(topics.values())
    return [len(t.encode("utf-8", "surrogatepass")) + 1 for t in texts]


def test_bfd_efficiency_on_embedded_corpus():
    lengths = _corpus_lengths()
    chunks = [c.length for c in split_long_documents(lengths, 1024)]
    bins = pack(lengths, 1024, algorithm="bfd", split_long=True)
    report = packing_report(bins, chunks, 1024)
    assert report.truncated_documents == 0
    assert report.real_tokens == sum(lengths)
    assert report.efficiency >= 0.98, str(report)
    assert report.num_bins <= report.lower_bound_bins * 1.02 + 1


def test_seed_without_effect_warns():
    with pytest.warns(UserWarning, match="seed=3 has no effect"):
        pack([1, 2], 4, algorithm="bfd", seed=3)
    lengths = list(range(1, 30))
    shuffled = {str(pack(lengths, 30, algorithm="shuffle_ff", seed=s)) for s in range(4)}
    assert len(shuffled) > 1, "shuffle_ff depends on its seed"
