"""Rowwise float8 and MX (1x32 block) quantization of weight shards, bit-equal to torchao's.

[Note: scales on a flat shard]
flatshard shards a weight as a 1-D fragment of its flattened (row-major) elements: rank ``r``
holds ``[start, end)`` of the flattened weight, and a shard boundary (a *cut*, core/layout.py:
multiples of the chunk size ``S``) may fall inside a row. Quantizing the shard in place, before
any gather, needs each scale's reduction over elements that may live on other ranks:

* **Rowwise float8** (torchao's ``"rowwise"`` recipe): the forward weight ``W`` (out x in) is
  cast as ``W.t()`` with ``axiswise_dim=0``, i.e. one scale per row of ``W``, taken over the
  reduction dim (``in``). A row wholly inside a fragment is local. A row that a cut splits
  (at most ``W - 1`` per weight) needs the other ranks' partial amaxes: :func:`row_amax` packs
  every *cut* row of every listed weight into one fp32 vector (0 where this rank holds none of
  the row: amaxes are >= 0) and issues ONE all-reduce(MAX) over the shard group for all of
  them; nothing for whole rows. MAX is exact in any dtype, and bf16/fp32 amaxes are exact in
  fp32, so the result equals the amax of the full row bit for bit. Every rank derives the same
  cut rows from the layout (``WeightShard.cuts``), so the vector has the same length and order
  everywhere; the ranks must list the same weights in the same order.
* **MX** (``torchao.prototype.mx_formats``, block 32 along rows): a block never needs another
  rank when no cut falls inside it: the row length and the fragment's both ends must be
  multiples of 32 (:func:`check_block_aligned`). flatshard's layout aligns offsets and chunks
  to 16 bytes (``align_elements``: 8 bf16 or 4 fp32 elements), which does not guarantee that:
  a layout whose ``align`` is a multiple of 32 elements does (``FlatLayout(..., align=
  math.lcm(align_elements(dtypes), 32))``: parameters start on 32-element boundaries and
  ``S``, a multiple of ``align``, too). ``FlatGroup`` would need an ``align`` argument (or an
  option naming the block) passed through from ``fs.shard``; the cost is < 32 zero elements
  per parameter and per rank chunk.

Arithmetic (torchao 0.18, ``float8_utils.amax_to_scale`` and ``_ToFloat8ConstrFunc``): amax in
the weight's dtype, then in float64 ``finfo(fp8).max / clamp(amax, min=1e-12)``, rounded to
float32; the rowwise recipe then rounds the scale down to a power of 2
(``exp2(floor(log2(s)))``); data: ``(w.float() * s).clamp(-max, max).to(fp8)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.distributed as dist
from torch import nn

from flatshard.comm.collectives import CommStats, all_reduce
from flatshard.core.flat_group import FlatGroup
from flatshard.core.state import get_state

FP8 = torch.float8_e4m3fn
EPS = 1e-12  # torchao's floor on an amax (float8_utils.EPS): an all-zero row gets a finite scale
MX_BLOCK = 32


@dataclass(frozen=True)
class WeightShard:
    """This rank's part of one 2-D weight: ``fragment`` holds the flattened weight's elements
    ``[start, start + fragment.numel())``; ``cuts`` are the positions in the flattened weight
    where the shard chunks split it (the same on every rank)."""

    name: str
    fragment: torch.Tensor
    shape: torch.Size
    start: int
    cuts: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.shape) != 2:
            raise ValueError(
                f"WeightShard {self.name!r}: shape={tuple(self.shape)} is not 2-D; rowwise and "
                "MX scales are defined for (out, in) weights: list only 2-D parameters"
            )
        if self.fragment.dim() != 1:
            raise ValueError(f"WeightShard {self.name!r}: fragment must be 1-D (a flat shard)")
        bounds = {0, *self.cuts, math.prod(self.shape)}
        inside = [c for c in self.cuts if self.start < c < self.end]
        if self.fragment.numel() and (self.start not in bounds or self.end not in bounds or inside):
            raise ValueError(
                f"WeightShard {self.name!r}: fragment [{self.start}, {self.end}) does not run "
                f"from one cut to the next (cuts={self.cuts}, numel {math.prod(self.shape)}): "
                "pass the cuts of the layout the fragment came from (layout_cuts)"
            )

    @property
    def end(self) -> int:
        return self.start + self.fragment.numel()

    @property
    def row_len(self) -> int:
        return self.shape[-1]

    @property
    def first_row(self) -> int:
        return self.start // self.row_len

    @property
    def rows_held(self) -> range:
        """Rows of the weight this fragment holds some of (empty for an empty fragment)."""
        if not self.fragment.numel():
            return range(0)
        return range(self.first_row, -(-self.end // self.row_len))

    def cut_rows(self) -> list[int]:
        """Rows that a cut splits between ranks, each once (same on every rank)."""
        return sorted({c // self.row_len for c in self.cuts if c % self.row_len})


def layout_cuts(shard_numel: int, world: int, offset: int, numel: int) -> tuple[int, ...]:
    """Where the chunk boundaries ``c * shard_numel`` fall inside the parameter at ``offset``
    (``numel`` elements) of a flat layout, in its flattened elements."""
    at = (c * shard_numel - offset for c in range(1, world))
    return tuple(p for p in at if 0 < p < numel)


def group_shards(group: FlatGroup, names: list[str] | None = None) -> list[WeightShard]:
    """The 2-D parameters of a ``FlatGroup`` as this rank holds them."""
    if group.has_tp:
        raise NotImplementedError(
            f"{group.label}: tensor-parallel weights are laid out by their TP-local tensors; "
            "rowwise/MX scales of the global weight are not supported for them"
        )
    shards = []
    for i, spec in enumerate(group.specs):
        if len(spec.shape) != 2:
            continue
        start = min(group.fragment_range(spec)[0], spec.numel)  # an empty one may lie past
        cuts = layout_cuts(group.shard_numel, group.world, spec.offset, spec.numel)
        name = names[i] if names is not None else f"{group.label} param {i}"
        shards.append(WeightShard(name, spec.fragment.detach(), spec.shape, start, cuts))
    return shards


def weight_shards(model: nn.Module) -> list[WeightShard]:
    """Every 2-D parameter of a sharded model (``fs.shard``), as this rank holds it, in plan
    order (the same on every rank of the shard group)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for unit in get_state(model).units:
        for group in unit.groups:
            out += group_shards(group, [names.get(id(s.fragment), "?") for s in group.specs])
    return out


# ---- rowwise float8 ---------------------------------------------------------------------------
@dataclass(frozen=True)
class RowwiseShard:
    """A fragment in float8 with its rows' scales: ``scales[i]`` is row ``first_row + i``'s
    (torchao's ``_scale`` of the full weight, flattened, rows ``rows_held``)."""

    data: torch.Tensor  # float8, the fragment's length
    scales: torch.Tensor  # float32, one per row held
    first_row: int


def _split(shard: WeightShard) -> tuple[int, int]:
    """Local ends of the head (the rest of a row begun on the previous rank) and of the body
    (whole rows); the tail (a row continued on the next rank) runs to the fragment's end."""
    k, n = shard.row_len, shard.fragment.numel()
    head = min(n, (-shard.start) % k)
    return head, head + (n - head) // k * k


def _local_row_amax(shard: WeightShard) -> torch.Tensor:
    """Amax of this rank's part of each row held (float32: exact for bf16 and fp32)."""
    x, (head, body) = shard.fragment.detach(), _split(shard)
    parts = []
    if head:
        parts.append(x[:head].abs().amax().reshape(1))
    if body > head:
        parts.append(x[head:body].view(-1, shard.row_len).abs().amax(dim=1))
    if x.numel() > body:
        parts.append(x[body:].abs().amax().reshape(1))
    if not parts:
        return torch.zeros(0, dtype=torch.float32, device=x.device)
    return torch.cat(parts).float()


def row_amax(
    shards: list[WeightShard], group: dist.ProcessGroup | None, stats: CommStats | None = None
) -> list[torch.Tensor]:
    """Per weight, the amax of each row held (``rows_held``) over the whole row: one
    all-reduce(MAX) over ``group`` for all cut rows together, none when no row is cut (see
    [Note: scales on a flat shard]). ``stats``: where it is counted (as "rowwise_amax")."""
    amaxes = [_local_row_amax(s) for s in shards]
    slots = [(i, r) for i, s in enumerate(shards) for r in s.cut_rows()]
    if not slots:
        return amaxes
    if group is None:
        raise ValueError(
            f"row_amax: group=None but {len(slots)} rows are cut between ranks (e.g. "
            f"{shards[slots[0][0]].name!r} row {slots[0][1]}): pass the shard process group"
        )
    flat = torch.cat(amaxes)
    starts = [0, *accumulate(a.numel() for a in amaxes)]  # each weight's in ``flat``
    held = [
        (k, starts[i] + r - shards[i].first_row)  # (place on the wire, place in ``flat``)
        for k, (i, r) in enumerate(slots)
        if r in shards[i].rows_held
    ]
    wire = torch.zeros(len(slots), dtype=torch.float32, device=flat.device)
    if held:
        at_wire = torch.tensor([k for k, _ in held], device=flat.device)
        at_flat = torch.tensor([j for _, j in held], device=flat.device)
        wire[at_wire] = flat[at_flat]
    all_reduce(wire, group, stats or CommStats(), op=dist.ReduceOp.MAX, name="rowwise_amax")
    if held:
        flat[at_flat] = wire[at_wire]
    return list(flat.split([a.numel() for a in amaxes]))


def amax_to_scale(
    amax: torch.Tensor, float8_dtype: torch.dtype = FP8, round_to_power_of_2: bool = True
) -> torch.Tensor:
    """torchao's ``amax_to_scale``: ``max / clamp(amax, EPS)`` in float64, then float32, then
    (the rowwise recipe) rounded down to a power of 2."""
    scale = (torch.finfo(float8_dtype).max / amax.double().clamp(min=EPS)).float()
    return torch.exp2(torch.floor(torch.log2(scale))) if round_to_power_of_2 else scale


def _quantize(shard: WeightShard, scales: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    """``(x.float() * its row's scale)``, saturated to the float8 range, cast."""
    x, (head, body), k = shard.fragment.detach(), _split(shard), shard.row_len
    pieces, row = [], 0
    if head:
        pieces.append(x[:head].float() * scales[0])
        row = 1
    if body > head:
        rows = (body - head) // k
        whole = x[head:body].view(rows, k).float() * scales[row : row + rows, None]
        pieces.append(whole.reshape(-1))
        row += rows
    if x.numel() > body:
        pieces.append(x[body:].float() * scales[row])
    limit = torch.finfo(float8_dtype).max
    scaled = torch.cat(pieces) if pieces else x.float()
    return scaled.clamp(min=-limit, max=limit).to(float8_dtype)


def rowwise_float8(
    shards: list[WeightShard],
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
    *,
    float8_dtype: torch.dtype = FP8,
    round_scales_to_power_of_2: bool = True,
) -> list[RowwiseShard]:
    """Each fragment in float8 with per-row scales, bit-equal to torchao's rowwise cast of the
    full weight (``Float8LinearConfig.from_recipe_name("rowwise")``, forward weight)."""
    out = []
    for shard, amax in zip(shards, row_amax(shards, group, stats), strict=True):
        scales = amax_to_scale(amax, float8_dtype, round_scales_to_power_of_2)
        out.append(RowwiseShard(_quantize(shard, scales, float8_dtype), scales, shard.first_row))
    return out


def rowwise_float8_of(model: nn.Module, **kwargs) -> dict[str, RowwiseShard]:
    """``rowwise_float8`` of every 2-D weight of a sharded model, by parameter name, over its
    shard group; the all-reduce is counted in ``fs.comm_stats(model)`` as "rowwise_amax"."""
    state, shards = get_state(model), weight_shards(model)
    results = rowwise_float8(shards, state.group, state.stats, **kwargs)
    return {s.name: r for s, r in zip(shards, results, strict=True)}


# ---- MX ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MXShard:
    """A fragment in MX: ``data`` (the element dtype) and one E8M0 scale per block of
    ``block_size``; ``scales[i]`` is block ``first_block + i`` of the flattened weight."""

    data: torch.Tensor
    scales: torch.Tensor  # torch.float8_e8m0fnu
    first_block: int


def check_block_aligned(shard: WeightShard, block_size: int = MX_BLOCK) -> None:
    """Raise unless every MX block of the fragment lies on this rank (see [Note: scales on a
    flat shard])."""
    if shard.row_len % block_size:
        raise ValueError(
            f"{shard.name!r}: rows of {shard.row_len} elements (shape {tuple(shard.shape)}) are "
            f"not a multiple of block_size={block_size}; torchao's MX cast needs that of the "
            "full weight too: pad the layer's input dim to a multiple of the block"
        )
    if shard.start % block_size or shard.end % block_size:
        raise ValueError(
            f"{shard.name!r}: fragment [{shard.start}, {shard.end}) of the flattened weight does "
            f"not start and end on a {block_size}-element block boundary, so a block is split "
            f"between ranks; fix: lay the flat group out with an align that is a multiple of "
            f"{block_size} elements (FlatLayout(align=math.lcm(align_elements(...), "
            f"{block_size}))): flatshard's default aligns to 16 bytes only"
        )


def mx_shard(
    shard: WeightShard, block_size: int = MX_BLOCK, elem_dtype: torch.dtype = FP8
) -> MXShard:
    """The fragment cast to MX by torchao's ``to_mx`` (FLOOR scales): each block is local
    (``check_block_aligned``), so no communication; bit-equal to the full weight's cast."""
    check_block_aligned(shard, block_size)
    try:
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except ImportError as err:
        hint = "pip install 'flatshard[float8]'"
        raise ImportError(f"mx_shard needs torchao ({err}): {hint}") from err
    scales, data = to_mx(shard.fragment.detach().contiguous(), elem_dtype, block_size)
    return MXShard(data, scales, shard.start // block_size)
