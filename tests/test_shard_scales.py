"""Rowwise float8 and MX scales computed on flat shards (``features/shard_scales.py``).

Rowwise: each rank quantizes only its fragments, with one all-reduce(MAX) of the cut rows'
partial amaxes, and the bytes and scales equal torchao's rowwise cast of the full weight (cases
in ``shard_scales_cases.py``, on every rank of a Gloo pool). MX: no communication, so every
rank's fragments of a layout are checked here, in one process, against torchao's ``to_mx``.
"""

from __future__ import annotations

import pytest
import torch

from flatshard.core.layout import FlatLayout, align_elements
from flatshard.features.shard_scales import (
    MX_BLOCK,
    WeightShard,
    check_block_aligned,
    mx_shard,
    row_amax,
)
from shard_scales_cases import layout_shards, rowwise_layout, rowwise_sharded, spiked

WIRE = torch.finfo(torch.float32).bits // 8  # bytes per cut row on the wire


def _check(results: list[dict]) -> None:
    first = results[0]
    assert first["cut_rows"] > 0, first  # the all-reduce path is exercised
    for rank, r in enumerate(results):
        assert r["mismatches"] == [], (rank, r["mismatches"])
        assert r["cut_rows"] == first["cut_rows"], (rank, r)  # every rank agrees on the rows
        assert r["calls"] == {"rowwise_amax": 1}, (rank, r["calls"])  # exactly one collective
        assert r["bytes"] == {"rowwise_amax": WIRE * r["cut_rows"]}, (rank, r["bytes"])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_rowwise_on_a_sharded_model_is_torchaos(dist_pools, world, dtype):
    results = dist_pools(world).run(rowwise_sharded, dtype)
    assert results[0]["names"] == ["0.weight", "2.weight", "3.weight"], results[0]["names"]
    assert all(r["checked"] > 0 for r in results), results
    _check(results)


def test_rowwise_without_power_of_2_scales(dist_pools):
    _check(dist_pools(2).run(rowwise_sharded, "fp32", False))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_rowwise_on_a_layout_with_a_long_row(dist_pools, world, dtype):
    """A row longer than a chunk (cut twice at world 3: one slot on the wire), and a zero row."""
    results = dist_pools(world).run(rowwise_layout, dtype)
    _check(results)
    assert results[0]["row_cut_twice"] == (world == 3), results[0]


# ---- MX: each rank's fragments on their own --------------------------------------------------
MX_SHAPES = [(5, 96), (3, 64), (7, 32)]  # chunk boundaries fall inside rows


def _mx_weights(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [spiked(torch.randn(s, generator=g) * 3).to(dtype) for s in MX_SHAPES]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mx_on_block_aligned_fragments_is_torchaos(world, dtype):
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    weights = _mx_weights(dtype)
    full = [MXTensor.to_mx(w, torch.float8_e4m3fn, MX_BLOCK) for w in weights]
    align = MX_BLOCK  # a multiple of 32 elements: every fragment is block-aligned
    for rank in range(world):
        layout = FlatLayout([w.shape for w in weights], world=world, rank=rank, align=align)
        for shard, ref in zip(layout_shards(layout, weights), full, strict=True):
            got = mx_shard(shard)
            data = ref.qdata.view(torch.uint8).reshape(-1)[shard.start : shard.end]
            blocks = slice(shard.start // MX_BLOCK, shard.end // MX_BLOCK)
            assert torch.equal(got.data.view(torch.uint8), data), (rank, shard.name)
            scales = ref.scale.view(torch.uint8).reshape(-1)[blocks]
            assert torch.equal(got.scales.view(torch.uint8), scales), (rank, shard.name)
            assert got.first_block == blocks.start
    cut = [s for s in layout_shards(layout, weights) if any(c % s.row_len for c in s.cuts)]
    assert cut, "no shard boundary inside a row: the layout does not test block-local rows"


def test_flatshard_default_alignment_splits_mx_blocks():
    """16-byte alignment (8 bf16 elements) cuts a block: the error names the weight and the
    fix."""
    weights = _mx_weights(torch.bfloat16)
    align = align_elements(torch.bfloat16)
    layout = FlatLayout([w.shape for w in weights], world=3, rank=1, align=align)
    shards = layout_shards(layout, weights)
    with pytest.raises(ValueError, match=r"'w\d'.*block boundary.*align that is a multiple of 32"):
        for shard in shards:
            check_block_aligned(shard)


def test_rows_not_a_multiple_of_the_block_are_refused():
    shard = WeightShard("proj", torch.zeros(40), torch.Size([2, 40]), 0, (40,))
    with pytest.raises(ValueError, match=r"'proj'.*40 elements.*block_size=32"):
        mx_shard(shard)


# ---- bad input --------------------------------------------------------------------------------
def test_a_fragment_off_the_cuts_is_refused():
    with pytest.raises(ValueError, match=r"'w'.*\[3, 9\).*cuts=\(5,\).*layout_cuts"):
        WeightShard("w", torch.zeros(6), torch.Size([3, 4]), 3, (5,))
    with pytest.raises(ValueError, match=r"'b'.*shape=\(4,\).*2-D"):
        WeightShard("b", torch.zeros(4), torch.Size([4]), 0, ())


def test_cut_rows_without_a_group_are_refused():
    shard = WeightShard("w", torch.ones(6), torch.Size([3, 4]), 0, (6,))
    with pytest.raises(ValueError, match=r"group=None.*'w' row 1.*shard process group"):
        row_amax([shard], None)
    whole = WeightShard("w", torch.ones(8), torch.Size([3, 4]), 0, (8,))
    assert [a.tolist() for a in row_amax([whole], None)] == [[1.0, 1.0]]  # no cut row: local
