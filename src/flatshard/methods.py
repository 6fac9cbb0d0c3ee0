"""``fs.register_method``: run a method other than ``forward`` with gathered parameters.

Forward hooks only fire around ``module(...)``. A method such as ``encode`` or ``generate`` that
reads the module's parameters directly (``self.embed.weight``) would see 1-D fragments. Once
registered, calling it gathers the unit that owns the module's parameters exactly as a forward
would (including the autograd node, so gradients reach the shards); calls to forward made from
inside it nest without releasing the parameters early.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import nn

from flatshard.core import hooks
from flatshard.core.state import get_state
from flatshard.core.unit import Unit


def register_method(model: nn.Module, name: str, *, submodule: nn.Module | None = None) -> None:
    """Make ``(submodule or model).<name>(...)`` run with its unit's parameters gathered."""
    state = get_state(model)
    target = model if submodule is None else submodule
    method = getattr(target, name, None)
    if not callable(method):
        raise ValueError(
            f"{type(target).__name__} has no method {name!r}; pass the name of a method "
            "defined on that module (e.g. 'generate')"
        )
    owner = _owning_unit(model, target, state.units)
    units = [u for u in state.units if u.module is owner.module]  # the root and its tail
    # Every member of a bucket of coalesced units runs once: the pass ends, so it is released.
    calls = [(u, m.module) for u in units for m in u.members]

    @functools.wraps(method)
    def gathered(*args, **kwargs):
        for unit, module in calls:
            hooks._pre_forward(state, unit, module, args, kwargs)
        try:
            return method(*args, **kwargs)
        finally:
            for unit, module in reversed(calls):
                hooks._post_forward(state, unit, module, args, kwargs, None)

    setattr(target, name, gathered)
    state.handles.append(_MethodHandle(target, name, gathered))


class _MethodHandle:
    """Undoes ``register_method`` (``fs.unshard``): the module's own method comes back."""

    def __init__(self, target: nn.Module, name: str, gathered: Callable) -> None:
        self.target, self.name, self.gathered = target, name, gathered

    def remove(self) -> None:
        if self.target.__dict__.get(self.name) is self.gathered:
            del self.target.__dict__[self.name]
            wrapped = self.gathered.__wrapped__  # functools.wraps: the method it gathers for
            if getattr(wrapped, "__func__", None) is not getattr(
                type(self.target), self.name, None
            ):
                setattr(self.target, self.name, wrapped)  # an instance attribute before


def _owning_unit(model: nn.Module, target: nn.Module, units: list[Unit]) -> Unit:
    """The innermost unit whose module contains ``target``."""
    by_module = {id(m.module): u for u in units for m in u.members}
    best = by_module.get(id(model))
    for module in model.modules():
        if id(module) in by_module and any(m is target for m in module.modules()):
            candidate = by_module[id(module)]
            if best is None or any(m is module for b in best.members for m in b.module.modules()):
                best = candidate
    if best is None:
        raise ValueError(f"{type(target).__name__} is not inside the sharded model")
    return best
