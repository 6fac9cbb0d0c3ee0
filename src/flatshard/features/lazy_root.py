"""The root regathered on demand: released after forward, gathered in backward only if needed.

[Note: the lazy root]
With the tail split off (see [Note: the root's tail] in ``root_split.py``) the root unit holds
what the forward uses *first*: typically the token and position embeddings. Their backward
needs no parameter at all (an embedding's gradient is a scatter of the output gradient), yet
a root kept gathered from forward to backward holds them, at the largest vocabularies the
biggest buffer of the model, through the loss, where memory peaks, and through the whole
backward. So this unit reshards after its forward like any other, and backward gathers it
again only when something actually reads it:

* **Saved tensors.** While its forward runs (with grad), saved-tensor hooks turn every saved
  tensor that views its buffers into a ``SavedView``; unpacking one in backward gathers the
  unit first (``regather``), then rebuilds the view. A tied head or a parameter used directly
  in the root's forward is saved like this, so it just works (one gather, when needed).
* **Recomputation and anything else.** Its pre-backward installs *placeholders* instead of
  views: tensors with the parameters' metadata whose first use (any torch function) gathers
  the unit and swaps in recompute views (outputs of an uncounted ``UnitViews`` node, as every
  pre-backward installs; see [Note: recomputation]). A checkpoint around root-level modules,
  or a backward hook reading a root parameter, reads real values.
* Ranks run the same backward graph, so they gather at the same point (or none do).

A root under ``root_split.LAZY_MIN_BYTES`` (1 MiB) stays gathered from forward into backward
instead: the hooks cost a Python call per saved tensor of the whole forward, more than such a
root's bytes are worth. They are not free above it either: 4-5 us of host time per saved
tensor (pack and unpack), 31-44 us per block of eight saved tensors, measured on the 2-core
box under load; see docs/performance.md ("Host overhead per unit") for what that is next to
the rest of a unit's machinery. When the saved-tensor hooks cannot be installed (someone else's
hooks are active around the root's forward, or it runs without grad), that step falls back
to regathering the root at its pre-backward, as any unit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch.utils._pytree import tree_map_only

from flatshard.features.saved_views import active_hooks, install_regathering

if TYPE_CHECKING:
    from flatshard.core.unit import Unit


def enter(unit: Unit, regather: Callable[[], None]) -> bool:
    """Pre-forward of the root: pack saved views of its buffers (one entry on
    ``unit.saved_hooks``, popped by ``saved_views.leave``). False: not possible this time."""
    if not torch.is_grad_enabled() or active_hooks() is not None:
        unit.saved_hooks.append(None)
        return False
    install_regathering(unit, regather)
    return True


# Reading these on a placeholder must not gather: they are answered from its own metadata.
_METADATA = {
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__, torch.Tensor.requires_grad.__get__, torch.Tensor.is_leaf.__get__,
    torch.Tensor.grad.__get__, torch.Tensor.grad_fn.__get__, torch.Tensor.layout.__get__,
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.stride, torch.Tensor.numel,
    torch.Tensor.is_floating_point, torch.Tensor.__repr__,
}  # fmt: skip


class OnDemand(torch.Tensor):
    """A placeholder parameter: metadata only; any other torch function on it first asks
    ``resolve`` for the real tensor (gathering the unit) and runs on that."""

    _resolve: Callable[[], torch.Tensor]

    @staticmethod
    def __new__(cls, shape, dtype, device, resolve: Callable[[], torch.Tensor]) -> OnDemand:
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        t._resolve = resolve
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func not in _METADATA:
            args, kwargs = tree_map_only(OnDemand, lambda t: t._resolve(), (args, kwargs or {}))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Reached only from C++ callers that bypass __torch_function__: resolve there too.
        args, kwargs = tree_map_only(OnDemand, lambda t: t._resolve(), (args, kwargs or {}))
        return func(*args, **kwargs)

    def __repr__(self) -> str:  # printing must not gather
        return f"OnDemand(shape={tuple(self.shape)}, dtype={self.dtype})"


def placeholders(unit: Unit, views: Callable[[], list[list[torch.Tensor]]]) -> list[list]:
    """One ``OnDemand`` per parameter of ``unit``, resolving to ``views()[group][index]``
    (``views`` gathers and builds the recompute views once, on first use)."""
    return [
        [
            OnDemand(
                s.shape if tp is None else tp.shape,  # a TP parameter resolves to its DTensor
                g.compute_dtype,
                g.device,
                lambda gi=gi, pi=pi: views()[gi][pi],
            )
            for pi, (s, tp) in enumerate(zip(g.specs, g.tp, strict=True))
        ]
        for gi, g in enumerate(unit.groups)
    ]
