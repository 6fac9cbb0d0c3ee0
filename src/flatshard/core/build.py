"""Building a sharded model's units and state from its wrap plan (``fs.shard``'s body).

``build_state`` turns the plan into ``Unit``s (each owning its parameters once, tied ones
included; the root split into root and tail, see features/root_split.py; a meta-device model
materialised unit by unit), places buffers on the compute device and makes the
``ShardedState`` that the hooks drive.
"""

from __future__ import annotations

from torch import nn

from flatshard.comm.collectives import CommStats
from flatshard.comm.debug import OpChecker
from flatshard.core.mesh import Topology
from flatshard.core.meta_init import check_nothing_on_meta, has_meta, materialize_unit
from flatshard.core.options import ShardOptions
from flatshard.core.state import ShardedState
from flatshard.core.strategy import reshards_after_forward
from flatshard.core.switches import Switches
from flatshard.core.unit import Unit, UnitRole
from flatshard.features import root_split
from flatshard.features.buckets import merge_buckets, plan_for
from flatshard.features.error_feedback import Residuals
from flatshard.features.float8 import float8_dtype_of, keep_private
from flatshard.features.root_split import tail_parameters
from flatshard.parallel.tensor import spec_of
from flatshard.parallel.unit_mesh import unit_topology
from flatshard.precision import MixedPrecision
from flatshard.wrap import Policy, WrapPlan, auto, build_plan, root_only


def build_state(
    model: nn.Module,
    plan: WrapPlan,
    topology: Topology,
    switches: Switches,
    options: ShardOptions,
) -> ShardedState:
    """The units of ``plan`` over ``topology``, and the state that drives them."""
    checker = OpChecker() if switches.debug else None
    stats = CommStats(checker=checker, p2p=switches.gloo_p2p, reduce_wire=options.comm.reduce)
    stats.gather_wire = options.comm.gather  # features/quantized_gather.py
    stats.residuals = Residuals() if options.comm.error_feedback else None  # error_feedback.py
    units, owned, slots = _build_units(model, plan, topology, stats, options)
    buckets = plan_for(options.coalesce, units, model)
    units = merge_buckets(units, buckets, owned, slots, options.mixed_precision, options.offload)
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
    keep_private(units)  # float8 groups: see [Note: float8 all-gather]
    check_nothing_on_meta(model)
    _place_buffers(model, topology, options.mixed_precision)
    return state


def wrap_plan(model: nn.Module, policy: Policy | None) -> WrapPlan:
    policy = auto() if policy is None else policy
    plan = build_plan(model, policy)
    if not plan.matched_any and not isinstance(policy, auto | root_only):
        raise ValueError(
            f"policy={policy!r} matched no module of {type(model).__name__}; check the class "
            "names or sizes it selects (everything would fall into one root unit)"
        )
    return plan


def describe(model: nn.Module, plan: WrapPlan, options: ShardOptions) -> list[str]:
    """What this rank is about to shard (the fingerprint's lines)."""
    unit_names = {id(m): n or "<root>" for n, m in model.named_modules() if m in plan.unit_modules}
    lines = [f"strategy={options.strategy.value}", f"mixed_precision={options.mixed_precision!r}"]
    lines += [f"unit {unit_names[id(m)]}{_mesh_text(plan, m)}" for m in plan.unit_modules]
    for name, p in model.named_parameters():
        tp = spec_of(p)
        where = "" if tp is None else f" tp={tp.describe()}"
        lines.append(f"param {name} {tuple(p.shape)} {p.dtype} grad={p.requires_grad}{where}")
    for name, b in model.named_buffers():
        lines.append(f"buffer {name} {tuple(b.shape)} {b.dtype}")
    lines += [f"reshard_root={options.reshard_root}", f"split_root={options.split_root}"]
    # The bound on every wait, as the switches: ranks that disagree report hangs differently.
    timeout = f"timeout_s={options.timeout.total_seconds():g}"
    lines.append(f"{timeout} (fs.shard(timeout_s=) or FLATSHARD_TIMEOUT_S)")
    return [*lines, f"coalesce={options.coalesce!r}", f"comm={options.comm!r}"]


def _mesh_text(plan: WrapPlan, module: nn.Module) -> str:
    """A unit's own mesh in the fingerprint (its size: ranks of different meshes differ)."""
    mesh = plan.meshes.get(id(module))
    if mesh is None:
        return ""
    return f" own_mesh_size={mesh.size()}"


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
    model: nn.Module, plan: WrapPlan, topology: Topology, stats: CommStats, options: ShardOptions
) -> tuple[list[Unit], dict[int, list], dict]:
    """The plan's units; the parameters each was built from (by ``id(unit)``: a bucket's
    members are rebuilt as one unit from them), and every parameter's places."""
    owned, slots = _owned_parameters(model, plan)
    built_from: dict[int, list] = {}
    own_meshes: dict[int, Topology] = {}  # per policy mesh (see _own_topology)
    units: list[Unit] = []
    built = {id(m) for m, params in zip(plan.unit_modules, owned, strict=True) if params}
    on_meta = has_meta(model)
    for module, params in zip(plan.unit_modules, owned, strict=True):
        if not params:  # a matched module whose parameters all belong to an ancestor
            if on_meta and module is model:  # a root of buffers only (a middle pipeline
                # stage: its rotary table): no ancestor materialises them, so do it here
                materialize_unit(module, [], slots, built, topology.device, options.init_fn)
            continue
        if on_meta:
            others = built - {id(module)}
            params = materialize_unit(
                module, params, slots, others, topology.device, options.init_fn
            )
        # The root's backward comes first, so resharding it after forward would only regather.
        is_root = module is model
        reshard = reshards_after_forward(options.strategy) and (not is_root or options.reshard_root)
        parts = _split_root(model, plan, params, slots) if is_root and options.split_root else []
        # The root with its tail split off is released after forward and regathered only if
        # backward needs it (see [Note: the lazy root]); the tail is the root as before.
        lazy = len(parts) == 2 and reshards_after_forward(options.strategy)
        lazy = lazy and root_split.worth_lazy(parts[0])
        # Never with float8 weights: their saved Float8TrainingTensors would read a released
        # buffer ([Note: float8 all-gather]).
        lazy = lazy and not any(float8_dtype_of(p) is not None for p in parts[0])
        own = _own_topology(model, module, plan, topology, options, own_meshes)
        for i, members in enumerate(parts or [params]):
            unit = Unit(
                len(units), module, members, slots, topology=own or topology, stats=stats,
                reshard_after_forward=reshard or (lazy and i == 0),
                mixed_precision=options.mixed_precision, offload=options.offload,
                role=_role(is_root, i, lazy),
            )  # fmt: skip
            units.append(unit)
            built_from[id(unit)] = members
    return units, built_from, slots


def _own_topology(
    model, module, plan: WrapPlan, topology: Topology, options, made: dict
) -> Topology | None:
    """The topology of a unit the policy gave its own mesh ([Note: per-unit meshes]), made
    once per mesh (``made``)."""
    mesh = plan.meshes.get(id(module))
    if mesh is None:
        return None
    if id(mesh) not in made:
        name = next(n for n, m in model.named_modules() if m is module)
        made[id(mesh)] = unit_topology(mesh, topology, options, f"module {name!r}")
    return made[id(mesh)]


def _role(is_root: bool, part: int, lazy: bool) -> UnitRole:
    """The role of part ``part`` of a unit module (the root may be split in [root, tail])."""
    if not is_root:
        return UnitRole.BLOCK
    if part == 1:
        return UnitRole.TAIL
    return UnitRole.LAZY_ROOT if lazy else UnitRole.ROOT


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
