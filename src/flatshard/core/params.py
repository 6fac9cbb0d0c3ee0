"""What each sharded parameter was: its name, its full shape, which part of it this rank holds.

After ``fs.shard`` every parameter the optimizer sees is a 1-D *fragment* of this rank's shard,
so code that reads ``p.dim()`` or ``p.shape`` (weight-decay grouping, Muon's "2-D only",
per-matrix learning rates) would read the fragment's. ``fs.full_shape(p)`` and
``fs.fragment_info(model)`` give back the original facts, so such code ports in one line:
``p.dim() >= 2`` becomes ``len(fs.full_shape(p)) >= 2``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from flatshard.core.state import ShardedState

TAG = "_flatshard_fragment"  # attribute of every fragment: its FragmentTag


@dataclass(frozen=True)
class FragmentTag:
    """Stored on each fragment ``nn.Parameter`` by ``fs.shard``."""

    full_shape: torch.Size
    flat_range: tuple[int, int]  # elements [start, end) of the flattened full parameter
    unit: int  # index into ShardedState.units
    group: int  # index into that unit's groups
    index: int  # index into that group's specs
    state: weakref.ReferenceType  # the ShardedState of the model the fragment belongs to
    # A tensor-parallel parameter's TPSpec (parallel/tensor.py): ``full_shape`` and
    # ``flat_range`` then describe its TP-local tensor, ``tp.shape`` the global one.
    tp: object = None

    @property
    def full_numel(self) -> int:
        return self.full_shape.numel()


@dataclass(frozen=True)
class FragmentInfo:
    """One parameter of a sharded model, as ``fs.fragment_info`` reports it."""

    name: str
    """Its name in ``model.named_parameters()`` (the first one, for tied parameters)."""
    full_shape: torch.Size
    """The shape of the original, unsharded parameter."""
    flat_range: tuple[int, int]
    """The elements ``[start, end)`` of the flattened full parameter this rank holds (empty
    when ``start == end``)."""
    unit: int
    """Index of the unit that gathers it."""
    fragment: nn.Parameter
    """This rank's 1-D fragment (what the optimizer steps on)."""
    global_shape: torch.Size | None = None
    """The parameter's shape over every rank that holds a part of it: ``full_shape`` unless
    it is tensor-parallel (its global DTensor shape) or on a unit with its own mesh (all the
    experts, from its module's ``flatshard_placement``); ``None`` when such a module does not
    say (see [Note: per-unit meshes])."""
    origin: tuple[int, ...] | None = None
    """Where the ``full_shape`` block sits in the ``global_shape`` tensor (zeros when they are
    the same)."""

    @property
    def full_ndim(self) -> int:
        return len(self.full_shape)


def tag_fragments(state: ShardedState) -> None:
    """Give every fragment of ``state``'s units its ``FragmentTag`` (called by ``fs.shard``)."""
    ref = weakref.ref(state)
    for unit in state.units:
        for gi, group in enumerate(unit.groups):
            for pi, spec in enumerate(group.specs):
                where = group.fragment_range(spec)
                tag = FragmentTag(spec.shape, where, unit.index, gi, pi, ref, group.tp[pi])
                setattr(spec.fragment, TAG, tag)


def fragment_tag(param: torch.Tensor) -> FragmentTag | None:
    """The tag of a flatshard fragment; None for any other tensor."""
    return getattr(param, TAG, None)


def is_fragment(param: torch.Tensor) -> bool:
    return fragment_tag(param) is not None


def full_shape(param: torch.Tensor) -> torch.Size:
    """The shape ``param`` had before ``fs.shard`` (its own shape if it is not a fragment);
    for a tensor-parallel parameter its global shape (over every tp rank)."""
    tag = fragment_tag(param)
    if tag is None:
        return param.shape
    return tag.full_shape if tag.tp is None else tag.tp.shape


def fragment_info(model: nn.Module) -> dict[str, FragmentInfo]:
    """Name -> ``FragmentInfo`` for every parameter of a sharded model, in
    ``named_parameters()`` order. ``ValueError`` if ``model`` is not sharded."""
    from flatshard.core.state import get_state

    get_state(model)
    out = {}
    for name, p in model.named_parameters():
        tag = fragment_tag(p)
        if tag is None:
            raise ValueError(
                f"parameter {name!r} of {type(model).__name__} is not a flatshard fragment "
                "(was it added after fs.shard?); register parameters before sharding"
            )
        shape, origin = _global_place(model, name, tag)
        out[name] = FragmentInfo(name, tag.full_shape, tag.flat_range, tag.unit, p, shape, origin)
    return out


def _global_place(model: nn.Module, name: str, tag: FragmentTag) -> tuple:
    """(global shape, origin of the local block) of a fragment (see ``FragmentInfo``)."""
    from flatshard.parallel.unit_mesh import placement

    if tag.tp is not None:
        return torch.Size(tag.tp.shape), tuple(tag.tp.origin)
    try:
        placed = placement(model, name, tag)
    except NotImplementedError:  # an expert whose module does not say where it sits
        return None, None
    if placed is not None:
        return torch.Size(placed[0]), placed[1]
    return tag.full_shape, (0,) * len(tag.full_shape)


def state_of_parameters(params: list[torch.Tensor], where: str) -> ShardedState:
    """The one sharded model ``params`` belong to; ``ValueError`` for plain tensors or a mix."""
    states = []
    for i, p in enumerate(params):
        tag = fragment_tag(p)
        state = tag.state() if tag is not None else None
        if state is None:
            raise ValueError(
                f"{where}: parameter {i} (shape {tuple(p.shape)}) is not a fragment of a "
                "sharded model; pass model.parameters() of a model that went through fs.shard"
            )
        if not any(s is state for s in states):
            states.append(state)
    if len(states) != 1:
        raise ValueError(
            f"{where}: the parameters belong to {len(states)} sharded models; call it once "
            "per model"
        )
    return states[0]
