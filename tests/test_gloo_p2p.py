"""The point-to-point all-gather / reduce-scatter used on Gloo equal Gloo's own collectives.

Each ``case_*`` runs on every rank of a Gloo pool; the pytest functions only dispatch and check.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from flatshard.comm import gloo_p2p
from flatshard.comm.collectives import CommStats, all_gather_into, reduce_scatter_sum
from flatshard.core.layout import chunk_spans

TIMEOUT = datetime.timedelta(seconds=60)
SIZES = (1, 5, 1024, 100_003)  # per-rank chunk sizes: odd, tiny, larger than a socket buffer


def _reference_sum_chunk(full: torch.Tensor, group) -> torch.Tensor:
    """This rank's chunk of the sum, from Gloo's all-reduce (in float64 to be order-free)."""
    total = full.double()
    dist.all_reduce(total, group=group)
    return total.view(dist.get_world_size(group), -1)[dist.get_rank(group)]


def _check_group(group, dtype: torch.dtype, seed: int) -> dict[str, float]:
    """Several collectives in flight at once (two gathers and a reduce posted before any wait),
    compared with Gloo's collectives; returns the worst error per operation."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    worst = {"gather": 0.0, "reduce": 0.0}
    for n in SIZES:
        g = torch.Generator().manual_seed(seed * 1000 + n * 10 + rank)
        shard_a = torch.randn(n, generator=g).to(dtype)
        shard_b = torch.randn(n, generator=g).to(dtype)
        full = torch.randn(n * world, generator=g).to(dtype)
        expected_sum = _reference_sum_chunk(full, group)
        out_a, out_b = torch.empty(n * world, dtype=dtype), torch.empty(n * world, dtype=dtype)
        reduced = torch.empty(n, dtype=dtype)
        works = [
            gloo_p2p.all_gather(out_a, shard_a, group),
            gloo_p2p.reduce_scatter_sum(reduced, full.clone(), group),
            gloo_p2p.all_gather(out_b, shard_b, group),
        ]
        for work in works:
            work.wait(TIMEOUT)
        for out, shard in ((out_a, shard_a), (out_b, shard_b)):
            expected = torch.empty(n * world, dtype=dtype)
            dist.all_gather_into_tensor(expected, shard, group=group)
            worst["gather"] = max(worst["gather"], (out - expected).abs().max().item())
        err = (reduced.double() - expected_sum).abs().max() / expected_sum.abs().max()
        worst["reduce"] = max(worst["reduce"], err.item())
    return worst


def case_p2p_matches_gloo(dtype_name: str) -> dict[str, dict[str, float]]:
    dtype = getattr(torch, dtype_name)
    world = dist.get_world_size()
    out = {"world": _check_group(dist.group.WORLD, dtype, seed=1)}
    # A subgroup that leaves rank 0 out: sends must go to *global* ranks.
    ranks = list(range(1, world)) if world > 2 else [0, 1]
    sub = dist.new_group(ranks)
    if dist.get_rank() in ranks:
        out["subgroup"] = _check_group(sub, dtype, seed=2)
    dist.barrier()
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_p2p_collectives_match_gloo(dist_pools, world, dtype_name):
    tolerance = 1e-6 if dtype_name == "float32" else 1e-2  # rounding of the ring's partial sums
    for result in dist_pools(world).run(case_p2p_matches_gloo, dtype_name):
        for errors in result.values():
            assert errors["gather"] == 0.0, result  # gathers copy bytes: exact
            assert errors["reduce"] <= tolerance, result


def case_switch(p2p: str) -> dict[str, object]:
    """The model's ``FLATSHARD_GLOO_P2P`` switch (``CommStats.p2p``) picks the algorithm; both
    give the same numbers."""
    group, world = dist.group.WORLD, dist.get_world_size()
    stats = CommStats(p2p=p2p == "1")
    shard = torch.full((3,), float(dist.get_rank()))
    gathered = torch.empty(3 * world)
    gather = all_gather_into(gathered, shard, group, stats)
    # In place, as the engine gathers: the shard is this rank's own chunk of the output.
    in_place = torch.full((3 * world,), -1.0)
    in_place[3 * dist.get_rank() :][:3] = float(dist.get_rank())
    gather_in_place = all_gather_into(in_place, in_place[3 * dist.get_rank() :][:3], group, stats)
    full = torch.arange(4.0 * world)
    reduced = torch.empty(4)
    reduce = reduce_scatter_sum(reduced, full, group, stats)
    p2p_work = isinstance(gather.work, gloo_p2p.P2PWork)  # before wait() drops it
    gather.wait(TIMEOUT)
    gather_in_place.wait(TIMEOUT)
    reduce.wait(TIMEOUT)
    return {
        "enabled": gloo_p2p.p2p_enabled(group, stats.p2p),
        "p2p_work": p2p_work,
        "gathered": gathered.tolist(),
        "gathered_in_place": in_place.tolist(),
        "reduced": reduced.tolist(),
    }


def test_switch_between_p2p_and_gloo_collectives(dist_pools):
    world = 3
    on, off = dist_pools(world).run(case_switch, "1"), dist_pools(world).run(case_switch, "0")
    for rank in range(world):
        assert on[rank]["enabled"] and on[rank]["p2p_work"]
        assert not off[rank]["enabled"] and not off[rank]["p2p_work"]
        expected_gather = [0.0] * 3 + [1.0] * 3 + [2.0] * 3
        assert on[rank]["gathered"] == off[rank]["gathered"] == expected_gather
        assert on[rank]["gathered_in_place"] == off[rank]["gathered_in_place"] == expected_gather
        expected = [world * float(4 * rank + i) for i in range(4)]
        assert on[rank]["reduced"] == off[rank]["reduced"] == expected


def case_pieces(dtype_name: str) -> float:
    """``reduce_scatter_pieces`` (per-parameter gradients: gaps, ``None``, a non-contiguous
    one) equals a reduce-scatter of the flat gradient they form; worst relative error."""
    dtype, world, rank = getattr(torch, dtype_name), dist.get_world_size(), dist.get_rank()
    numels = [7, 64, 1, 300, 33, 5]
    offsets, position = [], 0
    for n in numels:  # gaps of 0..3 elements between parameters, like alignment
        position += len(offsets) % 4
        offsets.append((position, n))
        position += n
    chunk = -(-(position + 2) // world)  # tail padding too
    spans = chunk_spans(offsets, chunk, world)
    worst = 0.0
    for trial in range(4):
        g = torch.Generator().manual_seed(100 * trial + rank)
        grads = [torch.randn(n, generator=g).to(dtype) for n in numels]
        grads[1] = torch.randn(16, 4, generator=g).to(dtype).t().reshape(-1)  # copied view
        grads[2 + trial % 3] = None  # an unused parameter, a different one per trial
        if rank == trial % world:
            grads[0] = None  # unused on one rank only
        flat = torch.zeros(chunk * world, dtype=torch.float64)
        for (offset, n), grad in zip(offsets, grads, strict=True):
            if grad is not None:
                flat[offset : offset + n] = grad.double()
        expected = _reference_sum_chunk(flat, dist.group.WORLD)
        out = torch.full((chunk,), float("nan"), dtype=dtype)
        gloo_p2p.reduce_scatter_pieces(out, tuple(grads), spans, dist.group.WORLD).wait(TIMEOUT)
        if not torch.isfinite(out).all():  # a gap or piece nobody wrote
            return float("inf")
        worst = max(worst, ((out.double() - expected).abs().max() / expected.abs().max()).item())
    return worst


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_reduce_scatter_from_pieces(dist_pools, world, dtype_name):
    tolerance = 1e-6 if dtype_name == "float32" else 1e-2
    errors = dist_pools(world).run(case_pieces, dtype_name)
    assert max(errors) <= tolerance, errors
