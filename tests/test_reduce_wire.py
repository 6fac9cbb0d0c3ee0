"""``fs.Comm(reduce="bf16")``: fp32 gradients travel as bf16 (an all-to-all over the shard group)
and are summed in fp32 where they arrive (``core/reduce.py`` ``reduce_on_wire``).

Under bf16 compute the gradients are bf16 already, so the sum equals the fp32 reduce-scatter's
up to its order (tolerance 1e-6 of the largest element: the bf16 reduce-scatter is off by
~1e-3, see ``bf16_err``), on every rank, at half the bytes; ranks that disagree on the option
fail at ``fs.shard``. The cases are in ``reduce_wire_cases.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import flatshard as fs
from flatshard.core.options import parse_options
from flatshard.precision import wire_dtype
from nccl_pool import strict_pools  # noqa: F401 (the fixture)
from reduce_wire_cases import disagree, parity

SUM_ORDER = 1e-6  # fp32 sums of the same bf16 addends in another order
BF16_LEVEL = 2.0**-8  # the accumulated (fp32) gradient is rounded once to bf16 on the wire


def _check_parity(results: list[dict], tolerance: float) -> None:
    for rank, r in enumerate(results):
        assert "all_to_all" in r["bytes"]["bf16 wire"], (rank, r["bytes"])  # the wire ran
        assert r["wire_err"] <= tolerance, (rank, r)
        assert r["bf16_err"] > 10 * r["wire_err"], (rank, r)  # the check can tell them apart


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op"])
def test_parity_with_the_fp32_reduce_scatter(dist_pools, world, strategy):
    _check_parity(dist_pools(world).run(parity, strategy), SUM_ORDER)


@pytest.mark.parametrize("world", [2, 3])
def test_parity_under_no_sync(dist_pools, world):
    """keep="sharded": each micro-batch travels bf16-exact; keep="unsharded": the fp32 sum of
    the micro-batches is rounded to bf16 once, on the wire (documented)."""
    _check_parity(dist_pools(world).run(parity, "full_shard", "sharded"), SUM_ORDER)
    for rank, r in enumerate(dist_pools(world).run(parity, "full_shard", "unsharded")):
        assert r["wire_err"] <= BF16_LEVEL, (rank, r)


@pytest.mark.parametrize("world", [2, 3])
def test_the_bytes_halve(dist_pools, world):
    for rank, r in enumerate(dist_pools(world).run(parity)):
        fp32, wire = r["bytes"]["fp32"], r["bytes"]["bf16 wire"]
        assert fp32["reduce_scatter"] > 0 and "all_to_all" not in fp32, (rank, fp32)
        assert "reduce_scatter" not in wire, (rank, wire)
        assert wire["all_to_all"] * 2 == fp32["reduce_scatter"], (rank, fp32, wire)
        assert r["bytes"]["bf16"]["reduce_scatter"] == wire["all_to_all"], (rank, r["bytes"])


def test_ranks_that_disagree_fail_at_shard(dist_pools):
    for rank, message in enumerate(dist_pools(2).run(disagree)):
        assert "ranks disagree" in message and "comm=Comm(reduce=" in message, (rank, message)


def test_nccl_path_and_hybrid_run_clean(strict_pools):  # noqa: F811
    """The device path (``strict_async``: NCCL's semantics, virtual streams): full_shard and
    hybrid_shard (2x2: the all-to-all over the shard group, then the fp32 all-reduce over
    the replicas, issued behind it on the reduce stream), each exact and with no violation."""
    from stream_cases import assert_clean, run_stream_cases

    jobs = [
        ("full_shard", "reduce_wire_cases", "parity", ("full_shard",)),
        ("hybrid_shard", "reduce_wire_cases", "parity", ("hybrid_shard",)),
    ]
    for rank, per_label in enumerate(strict_pools(4).run(run_stream_cases, jobs, timeout=600)):
        for label, r in per_label.items():
            assert_clean(r, rank, label)
            _check_parity([r["result"]], SUM_ORDER)
            assert r["collectives"].get("side", 0) > 0, r["collectives"]


# ---- the option itself (no process group) -----------------------------------------------------
def test_an_unknown_wire_names_the_value_the_parameter_and_the_choices():
    with pytest.raises(ValueError, match=r"Comm\(reduce='fp9'\).*None, 'bf16'"):
        fs.Comm(reduce="fp9")
    with pytest.raises(ValueError, match=r"reduce=torch\.bfloat16"):
        fs.Comm(reduce=torch.bfloat16)
    with pytest.raises(TypeError, match=r"fs\.Comm"):
        _parse(comm="bf16")


def _parse(strategy="full_shard", mp=None, comm=None):
    model = nn.Linear(2, 2)
    return parse_options(model, strategy, mp, None, None, None, None, False, None, True, comm)


@pytest.mark.parametrize(
    "strategy, reduce_dtype, why",
    [("no_shard", torch.float32, "no_shard"), ("full_shard", torch.bfloat16, "bfloat16")],
)
def test_a_wire_with_no_effect_warns(strategy, reduce_dtype, why):
    mp = fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    with pytest.warns(UserWarning, match=f"has no effect: .*{why}"):
        _parse(strategy, mp, fs.Comm(reduce="bf16"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _parse("full_shard", fs.MixedPrecision(torch.bfloat16, torch.float32), fs.Comm("bf16"))
        assert _parse().comm == fs.Comm()


def test_the_wire_applies_to_wider_sums_only():
    assert wire_dtype("bf16", torch.float32) is torch.bfloat16
    assert wire_dtype("bf16", torch.bfloat16) is None and wire_dtype("bf16", torch.float16) is None
    assert wire_dtype(None, torch.float32) is None
