"""Materialising a model built on the meta device, one unit at a time.

``fs.shard`` accepts a model whose parameters live on ``torch.device("meta")`` (no memory). For
each unit, just before its flat groups are built, the unit's own parameters get real (full)
storage, are initialised, copied into this rank's shard, and dropped: peak memory is one unit's
full parameters, so a model larger than one rank's memory can be created.

Initialisation runs ``init_fn(unit_module)`` (default: ``reset_parameters`` of the unit module,
or of its descendants when it has none). While it runs, parameters of *other* units that are
registered inside the unit module are swapped for meta placeholders, so an init that walks the
whole subtree cannot touch shards that were already built. New storage is filled with NaN first:
a parameter the init left untouched is reported instead of training on garbage.

A tensor-parallel (DTensor) parameter is drawn whole, as a plain tensor of its global shape,
and then cut to this rank's TP-local block. Drawn as a DTensor, each rank would draw its block
from the same generator state: on a CPU mesh torch keeps no per-shard random offsets
(``is_rng_supported_mesh`` is False), so every tp rank got the *same* numbers, a symmetric
start that training never breaks, and the numbers differed from the unsplit model's at every
tp degree. Drawn whole, they are the unsplit model's on every device and at every tp degree
(and the generator advances as in the unsplit run, which the pipeline's init replay assumes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from flatshard.parallel.tensor import TPSpec, as_dtensor, local_of, spec_of

InitFn = Callable[[nn.Module], None]


def has_meta(model: nn.Module) -> bool:
    tensors = [*model.parameters(), *model.buffers()]
    return any(t.device.type == "meta" for t in tensors)


def model_init_fn(model: nn.Module) -> InitFn | None:
    """The model's own initialiser, when it has one: a transformers ``PreTrainedModel``'s
    ``_init_weights(module)``, applied to every module of a unit children first, as
    ``PreTrainedModel.initialize_weights`` does (a parent's rule, such as GPT-2's scaled
    residual projections, comes last); a nested ``PreTrainedModel`` uses its own.

    So a transformers model built on the meta device initialises as it would have in full
    (norm weights, rotary tables, scaled projections), without an ``init_fn``. ``None`` for
    any other model: ``reset_parameters`` then.
    """
    if _own_init(model) is None:
        return None
    owners = {id(m): fn for m in model.modules() if (fn := _own_init(m)) is not None}

    def apply(module: nn.Module, fn: Callable[[nn.Module], None]) -> None:
        for child in module.children():
            apply(child, owners.get(id(child), fn))
        fn(module)

    def init_unit(unit_module: nn.Module) -> None:
        fn = next(owners[id(m)] for m in _ancestors(model, unit_module) if id(m) in owners)
        apply(unit_module, fn)

    return init_unit


def _own_init(module: nn.Module) -> Callable[[nn.Module], None] | None:
    init_weights = getattr(type(module), "_init_weights", None)
    if callable(init_weights) and hasattr(module, "config"):
        return module._init_weights
    return None


def _ancestors(root: nn.Module, target: nn.Module) -> list[nn.Module]:
    """``target`` and the modules above it up to ``root``, innermost first."""
    for name, module in root.named_modules():
        if module is target:
            chain, current = [root], root
            for part in name.split(".") if name else []:
                current = getattr(current, part)
                chain.append(current)
            return chain[::-1]
    return [root]


def default_init(module: nn.Module, skip: set[int] | None = None) -> None:
    """``module.reset_parameters()``, or that of each child subtree when it has none."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()
        return
    for child in module.children():
        if skip is None or id(child) not in skip:
            default_init(child, skip)


@torch.no_grad()
def materialize_unit(
    unit_module: nn.Module,
    owned: list[nn.Parameter],
    slots: dict[int, list[tuple[nn.Module, str]]],
    other_units: set[int],
    device: torch.device,
    init_fn: InitFn | None,
) -> list[nn.Parameter]:
    """Give the unit's meta parameters real, initialised storage; returns them (same order).
    A tensor-parallel one is drawn whole, then cut to its TP-local block (see the module's
    docstring)."""
    real, tp_blocks = [], {}
    for p in owned:
        if p.device.type != "meta":
            real.append(p)
            continue
        q = _install(nn.Parameter(_nan_full(p, device), p.requires_grad), slots, slots[id(p)])
        if (spec := spec_of(p)) is not None:
            tp_blocks[id(q)] = (spec, p.to_local().shape)
        real.append(q)
    _materialize_buffers(unit_module, other_units, device)
    with _foreign_params_on_meta(unit_module, {id(q) for q in real}):
        if init_fn is not None:
            init_fn(unit_module)
        else:
            default_init(unit_module, other_units)
    _check_initialised(real, slots, unit_module)
    return [_tp_local(q, *tp_blocks[id(q)], slots) if id(q) in tp_blocks else q for q in real]


def _install(q: nn.Parameter, slots: dict, places: list[tuple[nn.Module, str]]) -> nn.Parameter:
    """``q`` in every module slot of the parameter it replaces."""
    slots[id(q)] = places
    for module, name in places:
        module._parameters[name] = q
    return q


def _nan_full(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Real storage for the meta parameter ``p``, NaN-filled, of its full (global) shape."""
    return torch.full(p.shape, float("nan"), dtype=p.dtype, device=device)


def _tp_local(full: nn.Parameter, spec: TPSpec, shape: torch.Size, slots: dict) -> nn.Parameter:
    """The initialised whole tensor cut to this rank's TP-local block (``shape`` at
    ``spec.origin``), as its DTensor again."""
    cut = tuple(slice(o, o + n) for o, n in zip(spec.origin, shape, strict=True))
    block = full.detach()[cut]
    local = nn.Parameter(as_dtensor(block.clone(), spec), full.requires_grad)
    return _install(local, slots, slots.pop(id(full)))


def _materialize_buffers(unit_module: nn.Module, other_units: set[int], device) -> None:
    for module in _own_modules(unit_module, other_units):
        for name, buf in module._buffers.items():
            if buf is not None and buf.device.type == "meta":
                module._buffers[name] = torch.full_like(buf, float("nan"), device=device)


def _own_modules(unit_module: nn.Module, other_units: set[int]) -> Iterator[nn.Module]:
    """The unit module and its descendants, not descending into other units."""
    yield unit_module
    for child in unit_module.children():
        if id(child) not in other_units:
            yield from _own_modules(child, other_units)


@contextmanager
def _foreign_params_on_meta(unit_module: nn.Module, own: set[int]) -> Iterator[None]:
    swapped = []
    for module in unit_module.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) not in own and p.device.type != "meta":
                swapped.append((module, name, p))
                placeholder = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"))
                module._parameters[name] = placeholder
    try:
        yield
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p


def _check_initialised(real: list[nn.Parameter], slots: dict, unit_module: nn.Module) -> None:
    for q in real:
        if q.is_floating_point() and torch.isnan(local_of(q)).any():
            module, name = slots[id(q)][0]
            raise ValueError(
                f"parameter {name!r} of {type(module).__name__} was not initialised when "
                f"materialising {type(unit_module).__name__} from the meta device; give "
                f"{type(module).__name__} a reset_parameters() or pass fs.shard(init_fn=...)"
            )


def check_nothing_on_meta(model: nn.Module) -> None:
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device.type == "meta":
            raise ValueError(
                f"{name!r} is still on the meta device after fs.shard materialised the units; "
                "initialise it in reset_parameters() of its module or in init_fn"
            )
