"""PackedBatchSampler: lockstep micro-batch counts, coverage, balance, determinism, resume."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from flatshard.packing import PackedBatchSampler, pack

CAPACITY = 64


def _lengths(n: int = 300, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [min(CAPACITY, int(rng.lognormvariate(2.5, 1.0)) + 1) for _ in range(n)]


def _samplers(world: int, **kwargs) -> list[PackedBatchSampler]:
    lengths = kwargs.pop("lengths", None) or _lengths()
    return [
        PackedBatchSampler(lengths, CAPACITY, rank=r, world_size=world, **kwargs)
        for r in range(world)
    ]


def _run(samplers, steps: int | None = None) -> list[list[list[list[int]]]]:
    """Per step, per rank: that rank's micro-batches (all ranks advanced in lockstep)."""
    iters = [iter(s) for s in samplers]
    out = []
    while steps is None or len(out) < steps:
        step = [next(it, None) for it in iters]
        assert all(s is None for s in step) or all(s is not None for s in step), "ranks disagree"
        if step[0] is None:
            break
        out.append(step)
    return out


def _docs(steps) -> Counter:
    return Counter(d for step in steps for rank in step for mb in rank for d in mb)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("micro_batches", [1, 3])
def test_equal_micro_batch_counts_and_full_coverage(world, micro_batches):
    samplers = _samplers(world, micro_batches=micro_batches, bins_per_micro_batch=2)
    expected_steps = len(samplers[0])
    steps = _run(samplers)
    assert len(steps) == expected_steps > 1
    assert len(samplers[0]) == 0, "len() counts the steps left"
    for step in steps:
        counts = {len(rank) for rank in step}
        assert len(counts) == 1, f"micro-batch counts differ across ranks: {counts}"
        assert counts <= {micro_batches} or step is steps[-1]
    assert _docs(steps) == Counter(range(300)), "every document exactly once"


def test_micro_batches_hold_whole_bins():
    lengths = _lengths()
    (sampler,) = _samplers(1, lengths=lengths, shuffle=False)
    bins = {tuple(b) for b in pack(lengths, CAPACITY)}
    for step in sampler:
        for micro_batch in step:
            assert tuple(micro_batch) in bins


def test_drop_last_skips_the_partial_step():
    full = _run(_samplers(3, micro_batches=4))
    dropped = _run(_samplers(3, micro_batches=4, drop_last=True))
    assert len(dropped) == len(full) - 1
    assert all(len(rank) == 4 for step in dropped for rank in step)


def test_balance_beats_round_robin():
    lengths = [CAPACITY] * 20 + [4] * 320  # long-document bins cost far more (sum len^2)
    sampler = PackedBatchSampler(
        lengths, CAPACITY, rank=0, world_size=4, micro_batches=10, pair_cost=1.0, seed=1
    )
    plan = sampler.plan()
    _, costs = sampler._pack(0)
    dealt = [costs[i::4] for i in range(4)]  # round robin of the same 40 bins
    round_robin = max(map(sum, dealt)) / (sum(costs[:40]) / 4) - 1
    assert plan.imbalance < 0.05
    assert plan.imbalance < round_robin
    assert sum(plan.rank_costs) == pytest.approx(sum(costs[plan.start : plan.end]))


def test_deterministic_and_seed_and_epoch_dependent():
    def docs_of(seed, epoch):
        (sampler,) = _samplers(1, seed=seed)
        sampler.set_epoch(epoch)
        return [d for step in sampler for mb in step for d in mb]

    assert docs_of(0, 0) == docs_of(0, 0)
    assert docs_of(0, 0) != docs_of(1, 0)
    assert docs_of(0, 0) != docs_of(0, 1)


@pytest.mark.parametrize(("world", "new_world"), [(2, 2), (2, 3), (3, 2), (3, 1)])
def test_resume_covers_remaining_documents_exactly_once(world, new_world):
    samplers = _samplers(world, micro_batches=2, seed=7)
    for s in samplers:
        s.set_epoch(3)
    first = _run(samplers, steps=4)
    state = samplers[0].state_dict()
    assert all(s.state_dict() == state for s in samplers)
    resumed = _samplers(new_world, micro_batches=2, seed=7)
    for s in resumed:
        s.load_state_dict(state)
        s.set_epoch(3)  # the same epoch keeps the position
    rest = _run(resumed)
    seen = _docs(first) + _docs(rest)
    assert seen == Counter(range(300))
    if new_world == world:  # identical continuation
        uninterrupted = _samplers(world, micro_batches=2, seed=7)
        for s in uninterrupted:
            s.set_epoch(3)
        assert _run(uninterrupted)[4:] == rest


def test_load_state_dict_rejects_another_data_set():
    (sampler,) = _samplers(1)
    state = sampler.state_dict()
    (other,) = _samplers(1, lengths=_lengths(299))
    with pytest.raises(ValueError, match="num_documents"):
        other.load_state_dict(state)


def test_bad_rank():
    with pytest.raises(ValueError, match="rank=2"):
        PackedBatchSampler([1, 2], 4, rank=2, world_size=2)
