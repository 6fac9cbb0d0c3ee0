"""torchao float8 training: float8 weights gathered in float8 (1 byte per element).

[Note: float8 all-gather]
``torchao.float8.convert_to_float8_training(model, config=Float8LinearConfig(
enable_fsdp_float8_all_gather=True))`` gives each ``Float8Linear`` a weight of torchao's
``WeightWithDynamicFloat8CastTensor``. Torch FSDP2 asks that subclass to quantize its own shard
(``fsdp_pre_all_gather``) and gathers the float8 bytes. flatshard does the same inside its flat
layout:

* **Where the bytes go.** A unit's float8 weights form *one extra flat group of the unit*
  (``Unit`` groups parameters by (dtype, requires_grad, float8 dtype)): its shard and fragments
  hold the high-precision weights as any group's do (the optimizer steps on fp32 fragments), but
  its ``full`` buffer is ``uint8`` (``compute_dtype``): one byte per element. The alternative,
  one mixed buffer where float8 bytes sit beside the unit's bf16/fp32 parameters, would make
  every offset and every collective of a group byte-typed; a group of its own keeps every other
  group byte for byte as it was and reuses the layout, the gather and the reduction as they are.
  Gloo cannot all-gather float8 dtypes, so the bytes travel as ``uint8`` and are viewed back.
* **The scale.** Tensorwise, from the *global* amax of the whole weight: before a unit's
  gathers, ``set_scales`` all-reduces (MAX, over the shard group) one vector with the local
  amax of each float8 weight of the unit, one collective per unit; every rank then quantizes
  its own part of the shard with the same scale (``write_send_shard``). When every float8
  weight of the unit carries a ``_precomputed_scale`` (``float8_scales.py`` after the
  optimizer step, as torchao's ``precompute_float8_dynamic_scale_for_fsdp`` does for FSDP2),
  that collective is skipped.
* **Compute and gradients.** ``float8_views`` (a group's ``full_views``) hands each module a
  torchao ``Float8TrainingTensor`` over the gathered bytes and the scale, in the original
  dtype (the compute dtype: bf16 under ``MixedPrecision(param_dtype=bf16)``);
  ``Float8Linear`` uses it as is (already cast), and its high-precision weight gradient
  reaches ``UnitViews.backward`` like any parameter's, so the reduction and the fp32
  fragments are those of every group.
* **Buffers.** A float8 group never borrows a pooled buffer (``build.py``): the saved
  ``Float8TrainingTensor`` of ``Float8Linear``'s backward holds a view of ``full`` that the
  saved-tensor hooks cannot see through, so it must stay on the group's private storage, which
  the regather before backward refills in place (same shard, same scale, same bytes). For the
  same reason a root that holds float8 weights is never the lazy root (released after
  forward, regathered only on demand); ``summon_full_params`` refuses float8 weights.
* **Full state.** ``full_state_dict``, exports and checkpoints read the stored (high-precision)
  dtype through ``core/masters.py``: a float8 group's compute dtype differs from its stored one.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from flatshard.comm.collectives import CommStats
    from flatshard.core.mesh import Topology

# ``FlatGroup`` (core/flat_group.py) imports this module: its groups are typed ``Any`` here.
FlatGroup = Any

INSTALL_HINT = "pip install 'flatshard[float8]'"


def require_torchao(what: str) -> None:
    """Raise a clear error when torchao (the ``float8`` extra) is missing."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as err:
        raise ImportError(f"{what} needs torchao's float8 training: {INSTALL_HINT}") from err


def float8_dtype_of(param: torch.Tensor) -> torch.dtype | None:
    """The float8 dtype ``param`` (or a DTensor's local tensor) is gathered in: torchao's float8
    all-gather weight, else None. torchao is never imported here: a weight of its subclass
    means it is loaded."""
    fsdp_utils = sys.modules.get("torchao.float8.fsdp_utils")
    param = getattr(param, "_local_tensor", param)  # a DTensor (TP) holds torchao's weight inside
    if fsdp_utils is None or not isinstance(param, fsdp_utils.WeightWithDynamicFloat8CastTensor):
        return None
    return param._dtype


@dataclass
class Float8Group:
    """What a float8 flat group needs beyond a plain one (see [Note: float8 all-gather])."""

    float8_dtype: torch.dtype  # of the gathered bytes (e4m3 for weights)
    orig_dtype: torch.dtype  # what the Float8TrainingTensor computes as (the compute dtype)
    mm_configs: list[Any]  # per parameter: torchao's LinearMMConfig
    scales: list[torch.Tensor] = field(default_factory=list)  # per parameter, this gather's


def float8_group(params: list[torch.Tensor], orig_dtype: torch.dtype) -> Float8Group | None:
    """The float8 description of a flat group built from ``params`` (None: a plain group)."""
    dtypes = {float8_dtype_of(p) for p in params}
    if dtypes == {None}:
        return None
    if len(dtypes) != 1:
        raise ValueError(
            f"flatshard internal error: a flat group mixes float8 dtypes {sorted(map(str, dtypes))}"
        )
    return Float8Group(dtypes.pop(), orig_dtype, [p._linear_mm_config for p in params])


# ---- scales ------------------------------------------------------------------------------------
@torch.no_grad()
def set_scales(groups: list[FlatGroup], topo: Topology, stats: CommStats) -> None:
    """Each float8 weight's tensorwise scale for the next gather of its unit (``groups``: the
    unit's float8 groups): the precomputed ones, else one all-reduce(MAX) of the local amaxes."""
    specs = [(g, s) for g in groups for s in g.specs]
    precomputed = [getattr(s.fragment, "_precomputed_scale", None) for _, s in specs]
    if all(p is not None for p in precomputed):
        scales = precomputed
    else:
        tp = [g.tp[i] for g in groups for i in range(len(g.specs))]
        amax = global_amax([s.fragment for _, s in specs], topo.shard_group, stats, tp)
        scales = list(to_scales(amax, [g.float8.float8_dtype for g, _ in specs]))
    position = 0
    for g in groups:
        g.float8.scales = scales[position : position + len(g.specs)]
        position += len(g.specs)


def global_amax(
    fragments: list[torch.Tensor],
    group: dist.ProcessGroup | None,
    stats: CommStats,
    tp: list | None = None,
) -> torch.Tensor:
    """max(|w|) of each whole weight from its fragments: one all-reduce(MAX) of the vector over
    the shard group; and, for tensor-parallel weights (``tp``: each fragment's ``TPSpec`` or
    None), one more over each tp group: a TP-local block is part of the weight, whose one
    tensorwise scale torchao takes from the whole DTensor."""
    local = [f.detach().abs().max() if f.numel() else f.new_zeros(()) for f in fragments]
    amax = torch.stack(local).float()
    if group is not None and dist.get_world_size(group) > 1:
        stats.record("float8_amax", amax, group, "float8 amax")
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    by_tp_group: dict[int, tuple[dist.ProcessGroup, list[int]]] = {}
    for i, spec in enumerate(tp or ()):
        if spec is not None and spec.is_sharded:  # replicated over tp: the block is the weight
            tp_group = spec.mesh.get_group()
            by_tp_group.setdefault(id(tp_group), (tp_group, []))[1].append(i)
    for tp_group, index in by_tp_group.values():  # in parameter order: the same on every rank
        part = amax[index]
        stats.record("float8_amax", part, tp_group, "float8 amax over tp")
        dist.all_reduce(part, op=dist.ReduceOp.MAX, group=tp_group)
        amax[index] = part
    return amax


def to_scales(amax: torch.Tensor, float8_dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    from torchao.float8.float8_utils import amax_to_scale

    return [amax_to_scale(a, d) for a, d in zip(amax, float8_dtypes, strict=True)]


# ---- the gather's send side and the views ------------------------------------------------------
@torch.no_grad()
def write_send_shard(group: FlatGroup, dest: torch.Tensor) -> None:
    """This rank's shard quantized with each weight's scale, as bytes, into ``dest`` (uint8;
    alignment gaps and padding are zero bytes: float8 zeros)."""
    from torchao.float8.float8_utils import to_fp8_saturated

    dest.zero_()
    f8 = group.float8
    for spec, scale in zip(group.specs, f8.scales, strict=True):
        if spec.local_end > spec.local_start:
            hp = group.shard[spec.local_start : spec.local_end].to(dest.device, torch.float32)
            bits = to_fp8_saturated(hp * scale.to(dest.device), f8.float8_dtype)
            dest[spec.local_start : spec.local_end].copy_(bits.view(torch.uint8))


def send_shard(group: FlatGroup) -> torch.Tensor:
    """The quantized shard as a new uint8 tensor on the device (a group of one rank)."""
    out = torch.empty(group.shard_numel, dtype=torch.uint8, device=group.device)
    write_send_shard(group, out)
    return out


def float8_views(group: FlatGroup) -> list[torch.Tensor]:
    """One ``Float8TrainingTensor`` per weight over the gathered bytes (fresh objects each
    call, no autograd edge: ``UnitViews`` makes them its outputs)."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

    f8 = group.float8
    data = group.full.data.view(f8.float8_dtype)
    return [
        Float8TrainingTensor(
            data[s.offset : s.offset + s.numel].view(s.shape),
            scale.to(group.device),
            f8.orig_dtype,
            mm,
            gemm_input_role=GemmInputRole.WEIGHT,
        )
        for s, scale, mm in zip(group.specs, f8.scales, f8.mm_configs, strict=True)
    ]


def keep_private(units: list) -> None:
    """Float8 groups gather into their private buffer (see [Note: float8 all-gather])."""
    for unit in units:
        for g in unit.groups:
            if g.float8 is not None:
                g.pool = None


def convert_linears(model: nn.Module, *, emulate: bool, prefix: str = "") -> nn.Module:
    """torchao's ``convert_to_float8_training`` with the float8 all-gather on, over the
    ``nn.Linear`` modules whose name starts with ``prefix`` (the trainer's ``--model.float8``:
    the blocks' linears, not the head tied to the embedding). ``emulate``: on the CPU."""
    require_torchao("float8 training")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(emulate=emulate, enable_fsdp_float8_all_gather=True)
    return convert_to_float8_training(
        model, config=config, module_filter_fn=lambda _m, name: name.startswith(prefix)
    )
