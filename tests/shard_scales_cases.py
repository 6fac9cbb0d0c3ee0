"""Cases of tests/test_shard_scales.py run on every rank of a Gloo pool (``dist_pool.py``).

Each rank quantizes only its own fragments (``features/shard_scales.py``) and compares them,
byte for byte, with torchao's cast of the full weight, which every rank rebuilds from the same
seed and casts alone (no process group involved in the reference).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import flatshard as fs
from flatshard.comm.collectives import CommStats
from flatshard.core.layout import FlatLayout
from flatshard.features.shard_scales import (
    WeightShard,
    layout_cuts,
    rowwise_float8,
    rowwise_float8_of,
    weight_shards,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SPIKE = 50.0  # far above randn's largest: the part of a cut row without it has another scale


def spiked(weight: torch.Tensor) -> torch.Tensor:
    """One large element per row at a row-dependent column: whichever rank lacks it sees a
    partial amax ~15x too small, so a missing all-reduce changes that row's scale (even after
    rounding to a power of 2)."""
    rows, cols = weight.shape
    for r in range(rows):
        weight[r, (7 * r + 3) % cols] = (SPIKE + r) * (-1) ** r
    return weight


def tiny_model(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)  # every rank the same weights
    # Row lengths 37, 29, 45: the chunk boundaries of world 2 and 3 fall inside rows.
    model = nn.Sequential(nn.Linear(37, 29), nn.GELU(), nn.Linear(29, 45), nn.Linear(45, 11))
    with torch.no_grad():
        for m in model:
            if isinstance(m, nn.Linear):
                spiked(m.weight)
    return model.to(dtype)


def torchao_rowwise(weight: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's float8 cast of a forward weight under the "rowwise" recipe, as
    ``Float8Linear``'s forward issues it (``float8_linear.py``: ``weight.t()``, axiswise dim 0):
    the float8 bytes in ``weight``'s row-major order, and one scale per row."""
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

    config = Float8LinearConfig.from_recipe_name("rowwise")
    assert config.round_scales_to_power_of_2  # the recipe's; pow2=False checks the other path
    cast = config.cast_config_weight
    t = hp_tensor_to_float8_dynamic(
        weight.t(),
        cast.target_dtype,
        LinearMMConfig(),
        gemm_input_role=GemmInputRole.WEIGHT,
        scaling_granularity=cast.scaling_granularity,
        axiswise_dim=0,
        round_scales_to_power_of_2=pow2,
    )
    return t._data.t().contiguous().view(torch.uint8).reshape(-1), t._scale.reshape(-1)


def _compare(shard: WeightShard, got, weight: torch.Tensor, pow2: bool) -> list[str]:
    """Differences of one quantized fragment from torchao's cast of the full weight."""
    data, scales = torchao_rowwise(weight, pow2)
    rows = shard.rows_held
    out = []
    if not torch.equal(got.data.view(torch.uint8), data[shard.start : shard.end]):
        out.append(f"{shard.name}: data of [{shard.start}, {shard.end})")
    if not torch.equal(got.scales, scales[rows.start : rows.stop]):
        out.append(f"{shard.name}: scales of rows {rows}")
    return out


def rowwise_sharded(dtype: str, pow2: bool = True) -> dict:
    """``fs.shard`` a tiny model, quantize every weight's fragment rowwise; compare."""
    model = fs.shard(tiny_model(DTYPES[dtype]), policy=fs.wrap.by_type(nn.Linear))
    reference = dict(tiny_model(DTYPES[dtype]).named_parameters())
    fs.comm_stats(model, reset=True)
    got = rowwise_float8_of(model, round_scales_to_power_of_2=pow2)
    stats = fs.comm_stats(model)
    shards = weight_shards(model)
    mismatches = []
    for shard in shards:
        mismatches += _compare(shard, got[shard.name], reference[shard.name], pow2)
    return {
        "names": sorted(got),
        "cut_rows": sum(len(s.cut_rows()) for s in shards),
        "checked": sum(s.fragment.numel() for s in shards),
        "calls": dict(stats.calls),
        "bytes": dict(stats.bytes),
        "mismatches": mismatches,
    }


LAYOUT_SHAPES = [(1, 900), (5, 7), (9, 13)]  # row 0 of the first is longer than a chunk


def layout_weights(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    weights = [spiked(torch.randn(s, generator=g)).to(dtype) for s in LAYOUT_SHAPES]
    weights[2][2].zero_()  # an all-zero row: torchao's EPS floor on the amax
    return weights


def layout_shards(layout: FlatLayout, weights: list[torch.Tensor]) -> list[WeightShard]:
    """This rank's fragments of ``weights`` under ``layout`` (as ``FlatGroup`` cuts them)."""
    shards = []
    for i, (w, place) in enumerate(zip(weights, layout.places, strict=True)):
        start, end = layout.fragment_range(place)
        start, end = min(start, place.numel), min(end, place.numel)
        cuts = layout_cuts(layout.shard_numel, layout.world, place.offset, place.numel)
        shards.append(WeightShard(f"w{i}", w.reshape(-1)[start:end], w.shape, start, cuts))
    return shards


def rowwise_layout(dtype: str) -> dict:
    """Fragments cut straight from a ``FlatLayout`` (a row over three chunks at world 3)."""
    weights = layout_weights(DTYPES[dtype])
    layout = FlatLayout(
        [w.shape for w in weights], world=dist.get_world_size(), rank=dist.get_rank(), align=4
    )
    shards = layout_shards(layout, weights)
    stats = CommStats()
    got = rowwise_float8(shards, dist.group.WORLD, stats)
    mismatches = []
    for shard, result, w in zip(shards, got, weights, strict=True):
        mismatches += _compare(shard, result, w, pow2=True)
    cut_by = [sum(1 for c in s.cuts if c % s.row_len) for s in shards]
    return {
        "cut_rows": sum(len(s.cut_rows()) for s in shards),
        "row_cut_twice": any(n > len(s.cut_rows()) for n, s in zip(cut_by, shards, strict=True)),
        "calls": dict(stats.calls),
        "bytes": dict(stats.bytes),
        "mismatches": mismatches,
    }
