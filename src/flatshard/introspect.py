"""Ask a sharded model about itself: its units, its communication, its memory.

``fs.is_sharded(model)``, ``fs.units(model)``, ``fs.comm_stats(model)``,
``fs.memory_stats(model)``: what benchmarks, the trainer and tests need, without reaching into
the engine's private state. Every call is local to this rank (no collective).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from flatshard.core.state import STATE_ATTR, ShardedState, get_state
from flatshard.core.unit import ParamState, Unit
from flatshard.features.buckets import gathered_bytes


def is_sharded(model: nn.Module) -> bool:
    """Did ``model`` go through ``fs.shard`` (as the root)?"""
    return getattr(model, STATE_ATTR, None) is not None


@dataclass(frozen=True)
class UnitInfo:
    """One unit of a sharded model, as ``fs.units`` reports it."""

    index: int
    """Position of its unit in the plan (children before their parents; the root is last),
    as fragment tags (``fs.fragment_info``) name it: the members of a bucket of coalesced
    units are one unit and share it."""
    name: str
    """The unit module's name in ``model.named_modules()`` ("" for the root)."""
    module: nn.Module
    params: tuple[str, ...]
    """Names of the parameters it gathers (tied ones once, by their first name)."""
    numel: int
    """Elements of those parameters, unsharded."""
    full_bytes: int
    """Bytes of its full parameters in the compute dtype, padding included: what one gather
    of it holds, and the size ``fs.Coalesce(unit_bytes=...)`` compares."""
    gathered: bool
    """Its full parameters are allocated (or being gathered) right now."""
    reshard_after_forward: bool
    """It releases its full parameters after forward (full_shard, hybrid_shard; the root too
    once its tail is split off, see ``split_root``)."""
    part: str = ""
    """"tail" for the root's tail (``fs.shard(split_root=True)``): a second unit over the root
    module; "" otherwise."""
    lazy: bool = False
    """The lazy root: released after forward and regathered in backward only when something
    reads its parameters (a tied head's saved weight); only a root of at least 1 MiB whose
    tail was split off (``split_root``) is lazy."""
    bucket: int | None = None
    """Index of the bucket of coalesced units (``fs.Coalesce``) it shares its all-gather and
    reduce-scatter with; the members of a bucket report the same index (buckets are numbered
    from 0). None for a unit that is not coalesced."""


def units(model: nn.Module) -> list[UnitInfo]:
    """The units of a sharded model, in plan order; a bucket of coalesced units (one unit of
    the engine, see [Note: coalesced units]) as one entry per member module."""
    state = get_state(model)
    module_names = {id(m): n for n, m in model.named_modules()}
    param_names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for unit in state.units:
        for member in unit.members:
            specs = _member_specs(unit, member.params)
            out.append(
                UnitInfo(
                    index=unit.index,
                    name=module_names.get(id(member.module), ""),
                    module=member.module,
                    params=tuple(param_names.get(id(s.fragment), "?") for s in specs),
                    numel=sum(s.numel for s in specs),
                    full_bytes=member.full_bytes if unit.merged else gathered_bytes(unit),
                    gathered=unit.state is not ParamState.SHARDED,
                    reshard_after_forward=unit.reshard_after_forward,
                    part="tail" if unit.is_tail else "",
                    lazy=unit.regather_on_demand,
                    bucket=unit.bucket,
                )
            )
    return out


def _member_specs(unit: Unit, params: frozenset[int]) -> list:
    """The specs of ``unit``'s parameters that one member owns (all for a plain unit)."""
    specs = []
    for group, originals in zip(unit.groups, unit.built_from, strict=True):
        specs += [
            s for s, p in zip(group.specs, originals, strict=True) if p in params or not params
        ]
    return specs


@dataclass(frozen=True)
class CommStats:
    """Collectives this rank issued for the model since the last reset."""

    calls: dict[str, int]
    """Per operation ("all_gather", "reduce_scatter", "all_reduce", "usage_all_reduce", ...)."""
    bytes: dict[str, int]
    """Bytes this rank sent, per operation."""


def comm_stats(model: nn.Module, *, reset: bool = False) -> CommStats:
    """The counters now; ``reset=True`` zeroes them afterwards (call it before a step to
    count that step alone)."""
    stats = get_state(model).stats
    out = CommStats(dict(stats.calls), dict(stats.bytes))
    if reset:
        stats.reset()
    return out


@dataclass(frozen=True)
class MemoryStats:
    """flatshard's own count of the bytes it holds on this rank for the model."""

    shard_bytes: int
    """Parameter shards (what the optimizer steps on)."""
    gathered_bytes: int
    """Gathered (full) parameter buffers allocated now, pooled ones included."""
    gathered_peak_bytes: int
    """The most ``gathered_bytes`` has been since the last peak reset."""
    pool_allocations: int
    """Pooled gather buffers created so far (constant after the first step in steady state)."""
    cached_bytes: int = 0
    """Of ``gathered_bytes``: memory kept only for a later gather outside the gather pool.
    Always 0 now: a bucket of coalesced units is one unit whose own buffer is allocated at
    each gather and freed at each release (kept for the meaning of earlier reports)."""
    bucket_storage_allocations: int = 0
    """Times a bucket of coalesced units allocated fresh memory for its gather so far (a
    pooled buffer created for it, or its private buffer allocated)."""


def memory_stats(model: nn.Module, *, reset_peak: bool = False) -> MemoryStats:
    """The accounting now; ``reset_peak=True`` restarts the peak from the current value."""
    state = get_state(model)
    shards = {}
    for unit in state.units:
        for group in unit.groups:
            storage = group.shard.untyped_storage()
            shards[storage.data_ptr()] = storage.nbytes()
    account = state.gathered_bytes
    out = MemoryStats(
        shard_bytes=sum(shards.values()),
        gathered_bytes=account.current,
        gathered_peak_bytes=account.peak,
        pool_allocations=state.pool.allocations if state.pool is not None else 0,
        **_bucket_storages(state),
    )
    if reset_peak:
        account.peak = account.current
    return out


def _bucket_storages(state: ShardedState) -> dict[str, int]:
    """``cached_bytes`` (none: a merged unit's buffer is pooled or private like any unit's)
    and ``bucket_storage_allocations``: fresh full buffers of the merged units so far."""
    allocations = sum(g.allocations for u in state.units if u.merged for g in u.groups)
    return {"cached_bytes": 0, "bucket_storage_allocations": allocations}
