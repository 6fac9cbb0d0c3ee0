"""``fs.shard``: turn a module into a fully sharded one, in place."""

from __future__ import annotations

import datetime
import enum
import os
import warnings
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .coalesce import Coalesce
from .comm.collectives import CommStats
from .comm.debug import OpChecker
from .comm.fingerprint import check_ranks_agree
from .engine import hooks, root_split
from .engine.buckets import named_buckets
from .engine.mesh import Topology, require_initialized, resolve_topology
from .engine.meta_init import (
    InitFn,
    check_nothing_on_meta,
    has_meta,
    materialize_unit,
    model_init_fn,
)
from .engine.root_split import tail_parameters
from .engine.state import STATE_ATTR, ShardedState, get_state  # noqa: F401 (re-exported)
from .engine.unit import Unit
from .offload import CPUOffload
from .optim.guard import guard_optimizers
from .params import tag_fragments
from .precision import MixedPrecision
from .prefetch import Prefetch
from .switches import Switches
from .wrap import Policy, WrapPlan, auto, build_plan, root_only

DEFAULT_TIMEOUT_S = 600.0


class ShardingStrategy(str, enum.Enum):
    FULL_SHARD = "full_shard"  # ZeRO-3: reshard parameters after forward
    SHARD_GRAD_OP = "shard_grad_op"  # ZeRO-2: keep them gathered until the unit's backward
    NO_SHARD = "no_shard"  # DDP semantics
    HYBRID_SHARD = "hybrid_shard"  # shard within a group, replicate across groups


# Strategies that free a unit's gathered parameters after its forward (ZeRO-3 style).
RESHARD_AFTER_FORWARD = (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


def shard(
    model: nn.Module,
    *,
    policy: Policy | None = None,
    strategy: str | ShardingStrategy = "full_shard",
    mixed_precision: MixedPrecision | None = None,
    offload: CPUOffload | None = None,
    mesh: DeviceMesh | dist.ProcessGroup | None = None,
    timeout_s: float | None = None,
    init_fn: InitFn | None = None,
    prefetch: Prefetch | None = None,
    reshard_root: bool = False,
    coalesce: Coalesce | bool | None = None,
    split_root: bool = True,
) -> nn.Module:
    """Shard ``model``'s parameters over ``mesh`` (default: all ranks) and return it.

    ``policy`` picks the modules that become units (``fs.wrap.by_type``, ``fs.wrap.by_size`` or
    any ``callable(module) -> bool``; default ``fs.wrap.auto()``: the repeated block class;
    ``fs.wrap.root_only()`` for one unit); the rest belongs to the root unit. After this call
    ``model.named_parameters()`` yields, under the original names, this rank's 1-D fragment of
    every parameter: build the optimizer afterwards. ``timeout_s`` bounds every wait on a
    collective (default: ``$FLATSHARD_TIMEOUT_S`` or 600 s).

    A model built under ``torch.device("meta")`` is materialised unit by unit (peak memory: one
    unit): ``init_fn(unit_module)`` initialises each unit's parameters (default: a
    transformers model's own ``_init_weights`` on each module, otherwise the unit module's
    ``reset_parameters()``, or its children's); see ``flatshard.engine.meta_init``.

    ``reshard_root``: under ``full_shard``/``hybrid_shard`` the root unit stays gathered from
    its forward into its backward (default, as FSDP2: the root's backward comes first, so a
    reshard would only regather it). ``True`` releases it after forward like any unit: the
    root's gathered bytes are free while the loss is computed, for one all-gather more a step.

    ``coalesce``: small units that run one after another share one all-gather and one
    reduce-scatter (``fs.Coalesce``: default on, for units up to 2 MiB, chosen from the first
    iteration's forward order; ``False`` turns it off). Results are identical either way.

    ``split_root``: the root's parameters used only after the last unit (final norm, output
    head) form a unit of their own over the root module, gathered with the root but reduced
    and released as soon as their backward is done (see ``engine/root_split.py``).
    """
    options = _options(
        model, strategy, mixed_precision, offload, timeout_s, init_fn, prefetch, reshard_root,
        coalesce, split_root,
    )  # fmt: skip
    require_initialized()
    topology = resolve_topology(options.strategy.value, mesh)
    plan = _plan(model, policy)
    switches = Switches.from_environ()
    check_ranks_agree([*switches.describe(), *_describe(model, plan, options)], topology.mesh_group)
    stats = CommStats(checker=OpChecker() if switches.debug else None, p2p=switches.gloo_p2p)
    units = _build_units(model, plan, topology, stats, options)
    state = ShardedState(
        units,
        topology=topology,
        stats=stats,
        timeout=options.timeout,
        prefetch=options.prefetch,
        switches=switches,
        coalesce=options.coalesce,
        root=model,
    )
    if options.coalesce.buckets is not None:
        names = {id(m): n for n, m in model.named_modules()}
        state.install_buckets(named_buckets(options.coalesce, units, names, model))
    check_nothing_on_meta(model)
    _place_buffers(model, topology, mixed_precision)
    tag_fragments(state)
    guard_optimizers()
    hooks.register_hooks(state)
    if mixed_precision is not None:
        hooks.register_precision_casts(model, mixed_precision)
    setattr(model, STATE_ATTR, state)
    return model


@dataclass(frozen=True)
class _Options:
    """``fs.shard``'s arguments, checked."""

    strategy: ShardingStrategy
    mixed_precision: MixedPrecision | None
    offload: CPUOffload | None
    timeout: datetime.timedelta
    init_fn: InitFn | None
    prefetch: Prefetch
    reshard_root: bool
    coalesce: Coalesce
    split_root: bool


def _options(
    model,
    strategy,
    mixed_precision,
    offload,
    timeout_s,
    init_fn,
    prefetch,
    reshard_root,
    coalesce,
    split_root,
) -> _Options:
    _check_model(model)
    try:
        parsed = ShardingStrategy(strategy)
    except ValueError:
        choices = ", ".join(repr(s.value) for s in ShardingStrategy)
        raise ValueError(f"strategy={strategy!r} is unknown; choose one of {choices}") from None
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(
            f"mixed_precision={mixed_precision!r}: pass fs.MixedPrecision(param_dtype=...)"
        )
    if offload is not None and not isinstance(offload, CPUOffload):
        raise TypeError(f"offload={offload!r}: pass fs.CPUOffload(params=True)")
    if prefetch is not None and not isinstance(prefetch, Prefetch):
        raise TypeError(f"prefetch={prefetch!r}: pass fs.Prefetch(forward=..., backward=...)")
    if reshard_root and parsed not in RESHARD_AFTER_FORWARD:
        warnings.warn(
            f"fs.shard(reshard_root=True) has no effect with strategy={parsed.value!r}: its "
            "units stay gathered until their backward (use full_shard or hybrid_shard)",
            stacklevel=3,
        )
    prefetch = prefetch if prefetch is not None else Prefetch()
    timeout = _timeout(timeout_s)
    if init_fn is None and has_meta(model):
        init_fn = model_init_fn(model)  # a transformers model: its own _init_weights
    return _Options(
        parsed, mixed_precision, offload, timeout, init_fn, prefetch, reshard_root,
        _coalesce(coalesce), bool(split_root),
    )  # fmt: skip


def _coalesce(coalesce: Coalesce | bool | None) -> Coalesce:
    if coalesce is None or coalesce is True:
        return Coalesce()
    if coalesce is False:
        return Coalesce(unit_bytes=0)
    if not isinstance(coalesce, Coalesce):
        raise TypeError(
            f"coalesce={coalesce!r}: pass fs.Coalesce(unit_bytes=..., bucket_bytes=...), "
            "True (the default) or False"
        )
    return coalesce


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"fs.shard(model=...) got a {type(model).__name__}; pass a torch.nn.Module")
    for name, sub in model.named_modules():
        if hasattr(sub, STATE_ATTR):
            where = f"its submodule {name!r}" if name else "it"
            raise ValueError(
                f"{type(model).__name__} is already sharded ({where} went through fs.shard); "
                "call fs.shard once, on the root module, with a policy for the inner units"
            )


def _timeout(timeout_s: float | None) -> datetime.timedelta:
    seconds = (
        timeout_s
        if timeout_s is not None
        else float(os.environ.get("FLATSHARD_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    )
    if seconds <= 0:
        raise ValueError(f"timeout_s={seconds!r} must be positive (seconds to wait on a peer)")
    return datetime.timedelta(seconds=seconds)


def _plan(model: nn.Module, policy: Policy | None) -> WrapPlan:
    policy = auto() if policy is None else policy
    plan = build_plan(model, policy)
    if not plan.matched_any and not isinstance(policy, auto | root_only):
        raise ValueError(
            f"policy={policy!r} matched no module of {type(model).__name__}; check the class "
            "names or sizes it selects (everything would fall into one root unit)"
        )
    return plan


def _describe(model: nn.Module, plan: WrapPlan, options: _Options) -> list[str]:
    """What this rank is about to shard (the fingerprint's lines)."""
    unit_names = {id(m): n or "<root>" for n, m in model.named_modules() if m in plan.unit_modules}
    lines = [f"strategy={options.strategy.value}", f"mixed_precision={options.mixed_precision!r}"]
    lines += [f"unit {unit_names[id(m)]}" for m in plan.unit_modules]
    for name, p in model.named_parameters():
        lines.append(f"param {name} {tuple(p.shape)} {p.dtype} grad={p.requires_grad}")
    for name, b in model.named_buffers():
        lines.append(f"buffer {name} {tuple(b.shape)} {b.dtype}")
    lines += [f"reshard_root={options.reshard_root}", f"split_root={options.split_root}"]
    return [*lines, f"coalesce={options.coalesce!r}"]


def _owned_parameters(model: nn.Module, plan: WrapPlan) -> tuple[list[list], dict]:
    """Per unit module the parameters it owns (each once), and every parameter's places."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    owned: list[list[nn.Parameter]] = [[] for _ in plan.unit_modules]
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None:
                continue
            if id(p) not in slots:
                owned[plan.owner[id(p)]].append(p)
            slots.setdefault(id(p), []).append((module, name))
    return owned, slots


def _build_units(
    model: nn.Module, plan: WrapPlan, topology: Topology, stats: CommStats, options: _Options
) -> list[Unit]:
    owned, slots = _owned_parameters(model, plan)
    units: list[Unit] = []
    built = {id(m) for m, params in zip(plan.unit_modules, owned, strict=True) if params}
    on_meta = has_meta(model)
    for module, params in zip(plan.unit_modules, owned, strict=True):
        if not params:  # a matched module whose parameters all belong to an ancestor
            continue
        if on_meta:
            others = built - {id(module)}
            params = materialize_unit(
                module, params, slots, others, topology.device, options.init_fn
            )
        # The root's backward comes first, so resharding it after forward would only regather.
        is_root = module is model
        reshard = options.strategy in RESHARD_AFTER_FORWARD and (
            not is_root or options.reshard_root
        )
        parts = _split_root(model, plan, params, slots) if is_root and options.split_root else []
        # The root with its tail split off is released after forward and regathered only if
        # backward needs it (see [Note: the lazy root]); the tail is the root as before.
        lazy = len(parts) == 2 and options.strategy in RESHARD_AFTER_FORWARD
        lazy = lazy and root_split.worth_lazy(parts[0])
        for i, members in enumerate(parts or [params]):
            unit = Unit(
                len(units), module, members, slots, topology=topology, stats=stats,
                reshard_after_forward=reshard or (lazy and i == 0),
                mixed_precision=options.mixed_precision, offload=options.offload,
            )  # fmt: skip
            unit.regather_on_demand = lazy and i == 0
            unit.part = "tail" if i == 1 else ""
            units.append(unit)
    return units


def _split_root(model: nn.Module, plan: WrapPlan, params: list, slots: dict) -> list[list]:
    """The root's parameters as [root, tail] (see [Note: the root's tail]), [] if no tail."""
    tail = tail_parameters(model, plan.unit_modules, params, slots)
    if not tail:
        return []
    return [[p for p in params if all(p is not q for q in tail)], tail]


def _place_buffers(model: nn.Module, topology: Topology, mp: MixedPrecision | None) -> None:
    """Module buffers to the compute device (floating ones in ``buffer_dtype`` under mixed
    precision); they are not sharded."""
    buffer_dtype = mp.buffer_dtype if mp is not None else None
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is None:
                continue
            dtype = buffer_dtype if buffer_dtype and buf.is_floating_point() else buf.dtype
            module._buffers[name] = buf.to(topology.device, dtype)
