"""Saved-tensor hooks that let autograd keep views of *pooled* gather buffers across a reshard.

See [Note: gather buffers and saved tensors] in ``gather_pool.py``. While a unit whose buffers
come from the pool runs its forward (with grad), ``pack`` turns each saved tensor that views a
pooled buffer into a :class:`SavedView` (which group, where in its buffer) and ``unpack`` rebuilds
the view from that group's buffer of the moment, which the pre-backward hook has regathered
(same shard, so the same bytes). Every other saved tensor is kept as is (detached: keeping the
tensor itself would tie an output to its own ``grad_fn`` in a reference cycle).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from flatshard.core.flat_group import FlatGroup
    from flatshard.core.unit import Unit
    from flatshard.features.gather_pool import GatherPool


@dataclass(frozen=True)
class SavedView:
    """Where a saved tensor lies in a group's gathered buffer."""

    group: FlatGroup
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    regather: Callable[[], None] | None = None  # gathers the group's unit when released

    def rebuild(self) -> torch.Tensor:
        """The saved view, on the group's buffer of this moment (gathered first if need be)."""
        group = self.group
        if not group.is_allocated and self.regather is not None:
            self.regather()  # see [Note: the lazy root] in lazy_root.py
        if not group.is_allocated:
            raise RuntimeError(
                f"flatshard internal error: backward needs {group.label}, which is not gathered "
                "(set FLATSHARD_GATHER_POOL=0 to work around it, and please report it)"
            )
        return group.full.data.as_strided(self.size, self.stride, self.offset)


@dataclass(frozen=True)
class SavedDTensorView:
    """A saved DTensor (a tensor-parallel weight, as autograd saves it) whose local tensor is
    a :class:`SavedView`: rebuilt as the same DTensor over the buffer of that moment."""

    local: SavedView
    mesh: Any
    placements: tuple
    shape: torch.Size
    stride: tuple[int, ...]

    def rebuild(self) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            return DTensor.from_local(
                self.local.rebuild(), self.mesh, self.placements, run_check=False,
                shape=self.shape, stride=self.stride,
            )  # fmt: skip


def make_hooks(
    pool: GatherPool, outer_pack: Callable[[torch.Tensor], Any] | None = None
) -> torch.autograd.graph.saved_tensors_hooks:
    """``outer_pack``: the pack hook of an enclosing unit (of this model, of another sharded
    model, or the lazy root), asked about tensors this pool does not own."""

    def pack(tensor: torch.Tensor) -> Any:
        try:
            group = pool.owner(tensor)
        except (RuntimeError, NotImplementedError):  # no plain storage (sparse, nested, ...)
            group = None
        if group is not None:
            return SavedView(group, tensor.storage_offset(), tuple(tensor.size()), tensor.stride())
        return tensor.detach() if outer_pack is None else outer_pack(tensor)

    def unpack(saved: Any) -> torch.Tensor:
        if not isinstance(saved, SavedView):
            return saved
        return saved.rebuild()

    pack.flatshard_pool = pool  # type: ignore[attr-defined]  # see active_hooks
    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


FOREIGN = "foreign"
CHECKPOINT = "checkpoint"


def active_hooks() -> tuple[Callable, Callable] | str | None:
    """The saved-tensor hooks active now: None, flatshard's own (pack, unpack) of an enclosing
    unit, ``CHECKPOINT`` for torch's non-reentrant checkpoint (it keeps no saved tensor: the
    recomputation in backward reads the buffer of that moment), or ``FOREIGN`` for someone
    else's (``save_on_cpu``, ...), which ours would shadow. If torch does not say, assume
    foreign."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return FOREIGN
    try:
        hooks = top(True)
    except TypeError:  # older signature without ``ignore_is_tracing``
        hooks = top()
    if hooks is None or hasattr(hooks[0], "flatshard_pool"):
        return hooks
    if getattr(hooks[0], "__qualname__", "").startswith("_checkpoint_hook."):
        return CHECKPOINT
    return FOREIGN


def enter(pool: GatherPool | None, unit: Unit) -> None:
    """Pre-forward of ``unit``: protect its pooled buffers' saved views (one entry per call on
    ``unit.saved_hooks``, ``None`` when nothing was installed, so that calls nest)."""
    hooks = None
    if pool is not None and torch.is_grad_enabled() and any(g.is_pooled for g in unit.groups):
        active = active_hooks()
        if active == CHECKPOINT:  # pooled buffers are safe: nothing of theirs is saved
            pass
        elif active == FOREIGN:
            for g in unit.groups:
                g.move_to_private()
        else:
            # An enclosing unit (of this model or another, or the lazy root) sees what this
            # one does not own: a view of its own buffer saved in here.
            outer = active[0] if active is not None else None
            hooks = make_hooks(pool, outer)
            hooks.__enter__()
    unit.saved_hooks.append(hooks)


def enter_regathering(unit: Unit, regather: Callable[[], None]) -> None:
    """Pre-forward inside ``fs.pipeline_step``: every saved tensor that views one of ``unit``'s
    buffers (pooled, private or a bucket's) becomes a ``SavedView`` that gathers the unit
    again when a later pass (a split backward's weight pass) unpacks it after a release.
    Chained behind an enclosing unit's hooks as ``enter``; nothing under someone else's."""
    active = active_hooks()
    if not torch.is_grad_enabled() or active in (FOREIGN, CHECKPOINT):
        unit.saved_hooks.append(None)
        return
    install_regathering(unit, regather, active[0] if active is not None else None)


def install_regathering(unit: Unit, regather: Callable[[], None], outer=None) -> None:
    """Enter saved-tensor hooks that pack views of ``unit``'s buffers as ``SavedView``s that
    ``regather`` it when unpacked after a release (one entry on ``unit.saved_hooks``); a
    saved DTensor over such a view (a tensor-parallel weight) as a ``SavedDTensorView``;
    other tensors go to ``outer`` (an enclosing unit's pack) or are kept as they are."""
    owners = {g.full.untyped_storage().data_ptr(): g for g in unit.groups if g.is_allocated}

    def view_of(tensor: torch.Tensor) -> SavedView | None:
        try:
            group = owners.get(tensor.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # no plain storage (sparse, nested, ...)
            return None
        if group is None:
            return None
        size, stride = tuple(tensor.size()), tensor.stride()
        return SavedView(group, tensor.storage_offset(), size, stride, regather)

    def pack(tensor: torch.Tensor) -> Any:
        local = getattr(tensor, "_local_tensor", None)  # a DTensor: a TP weight's view
        if local is not None and (saved := view_of(local)) is not None:
            placements, shape = tuple(tensor.placements), tensor.shape
            return SavedDTensorView(saved, tensor.device_mesh, placements, shape, tensor.stride())
        if local is None and (saved := view_of(tensor)) is not None:
            return saved
        return tensor.detach() if outer is None else outer(tensor)

    def unpack(saved: Any) -> torch.Tensor:
        return saved.rebuild() if isinstance(saved, (SavedView, SavedDTensorView)) else saved

    pack.flatshard_pool = None  # type: ignore[attr-defined]  # flatshard's: inner units chain
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
    hooks.__enter__()
    unit.saved_hooks.append(hooks)


def leave(unit: Unit) -> None:
    """Post-forward of ``unit``: undo the matching :func:`enter`."""
    if unit.saved_hooks and (hooks := unit.saved_hooks.pop()) is not None:
        hooks.__exit__(None, None, None)
