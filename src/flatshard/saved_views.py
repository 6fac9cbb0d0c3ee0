"""Saved-tensor hooks that let autograd keep views of *pooled* gather buffers across a reshard.

See [Note: gather buffers and saved tensors] in ``gather_pool.py``. While a unit whose buffers
come from the pool runs its forward (with grad), ``pack`` turns each saved tensor that views a
pooled buffer into a :class:`SavedView` (which group, where in its buffer) and ``unpack`` rebuilds
the view from that group's buffer of the moment, which the pre-backward hook has regathered
(same shard, so the same bytes). Every other saved tensor is kept as is (detached: keeping the
tensor itself would tie an output to its own ``grad_fn`` in a reference cycle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .flat_group import FlatGroup
    from .gather_pool import GatherPool
    from .unit import Unit


@dataclass(frozen=True)
class SavedView:
    """Where a saved tensor lies in a group's gathered buffer."""

    group: FlatGroup
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def make_hooks(pool: GatherPool) -> torch.autograd.graph.saved_tensors_hooks:
    def pack(tensor: torch.Tensor) -> Any:
        try:
            group = pool.owner(tensor)
        except (RuntimeError, NotImplementedError):  # no plain storage (sparse, nested, ...)
            group = None
        if group is None:
            return tensor.detach()
        return SavedView(group, tensor.storage_offset(), tuple(tensor.size()), tensor.stride())

    def unpack(saved: Any) -> torch.Tensor:
        if not isinstance(saved, SavedView):
            return saved
        group = saved.group
        if not group.is_allocated:
            raise RuntimeError(
                f"flatshard internal error: backward needs {group.label}, which is not gathered "
                "(set FLATSHARD_GATHER_POOL=0 to work around it, and please report it)"
            )
        return group.full.data.as_strided(saved.size, saved.stride, saved.offset)

    pack.flatshard = True  # type: ignore[attr-defined]  # see other_hooks_active
    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def other_hooks_active() -> bool:
    """Are saved-tensor hooks of someone else (``save_on_cpu``, ...) active? Ours would shadow
    them. Ours (an enclosing unit's) do not count. If torch does not say, assume they are."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return True
    try:
        hooks = top(True)
    except TypeError:  # older signature without ``ignore_is_tracing``
        hooks = top()
    return hooks is not None and not getattr(hooks[0], "flatshard", False)


def enter(pool: GatherPool | None, unit: Unit) -> None:
    """Pre-forward of ``unit``: protect its pooled buffers' saved views (one entry per call on
    ``unit.saved_hooks``, ``None`` when nothing was installed, so that calls nest)."""
    hooks = None
    if pool is not None and torch.is_grad_enabled() and any(g.is_pooled for g in unit.groups):
        if other_hooks_active():
            for g in unit.groups:
                g.move_to_private()
        else:
            hooks = make_hooks(pool)
            hooks.__enter__()
    unit.saved_hooks.append(hooks)


def leave(unit: Unit) -> None:
    """Post-forward of ``unit``: undo the matching :func:`enter`."""
    if unit.saved_hooks and (hooks := unit.saved_hooks.pop()) is not None:
        hooks.__exit__(None, None, None)
