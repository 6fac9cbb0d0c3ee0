"""What a checkpoint holds, by name: the DCP items of this rank and the JSON description.

Keys: a parameter or buffer is stored under its own name (tied parameters once, under the first
name, the other names recorded as aliases); an optimizer state tensor under
``optim/<parameter name>/<state key>``. A parameter is a global tensor of its full shape, of
which this rank writes the rectangles its fragment covers (see planner.py); a state tensor with
the fragment's shape is sharded the same way, with the parameter's full shape; any other
state tensor (AdamW's ``step``) is replicated; non-tensor state values go to the JSON.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flatshard.checkpoint import jsonable
from flatshard.checkpoint.planner import Item, Pickled, Sharded
from flatshard.core.params import fragment_tag
from flatshard.core.state import StateMode, get_state
from flatshard.parallel.unit_mesh import placement

OPTIM_PREFIX = "optimizer."  # the keys torch's get_optimizer_state_dict flattens to
OPTIM_PREFIX_V1 = "optim/"  # version-1 checkpoints: optim/<name>/<key>


def optim_key(name: str, key: str, version: int = 2) -> str:
    """The DCP key of parameter ``name``'s optimizer state ``key``: torch's flattened
    ``optimizer.state.<name>.<key>`` (version 1: ``optim/<name>/<key>``)."""
    if version == 1:
        return f"{OPTIM_PREFIX_V1}{name}/{key}"
    return f"{OPTIM_PREFIX}state.{name}.{key}"


@dataclass
class ParamInfo:
    """One original parameter as this rank holds it."""

    name: str
    fragment: nn.Parameter
    start: int  # the fragment is elements [start, start + fragment.numel()) of the flat param
    numel: int  # of the flat param (a tensor-parallel one's TP-local block)
    shape: torch.Size  # the global shape
    local_shape: torch.Size  # what ``start``/``numel`` index: ``shape``, or the TP-local block's
    origin: tuple[int, ...] | None = None  # where a TP-local block sits in the global tensor

    def item(self, local: torch.Tensor) -> Sharded:
        """``local`` (the fragment or a state tensor shaped like it) as its DCP item."""
        whole = self.shape if self.origin is not None else None
        return Sharded(local, self.start, self.numel, self.local_shape, whole, self.origin)


@dataclass
class ModelLayout:
    params: dict[str, ParamInfo]  # first names of parameters, in state_dict order
    buffers: dict[str, torch.Tensor]
    aliases: dict[str, str]  # tied name -> first name
    keys: list[str]  # every state_dict key, in order

    @property
    def name_of(self) -> dict[int, str]:
        return {id(p.fragment): name for name, p in self.params.items()}


def model_layout(model: nn.Module) -> ModelLayout:
    """Parameters, buffers and aliases of a sharded ``model``, keyed like its ``state_dict``."""
    state = get_state(model)
    if state.mode is StateMode.SUMMONED:
        raise ValueError(
            "cannot checkpoint inside fs.summon_full_params (parameters are full views there); "
            "save or load after the with-block"
        )
    layout = ModelLayout({}, {}, {}, [])
    first: dict[int, str] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        layout.keys.append(key)
        if key.startswith(OPTIM_PREFIX):
            raise ValueError(f"state_dict key {key!r} collides with the optimizer key prefix")
        if (tag := fragment_tag(value)) is not None:  # a fragment knows where it lives
            if id(value) in first:
                layout.aliases[key] = first[id(value)]
                continue
            first[id(value)] = key
            start, shape = tag.flat_range[0], tag.full_shape
            placed = placement(model, key, tag)  # an expert's place among all experts
            if placed is not None:
                info = ParamInfo(key, value, start, tag.full_numel, torch.Size(placed[0]), shape)
                info.origin = placed[1]
                layout.params[key] = info
            elif tag.tp is None:
                layout.params[key] = ParamInfo(key, value, start, tag.full_numel, shape, shape)
            else:
                info = ParamInfo(key, value, start, tag.full_numel, tag.tp.shape, shape)
                info.origin = tag.tp.origin
                layout.params[key] = info
        elif isinstance(value, torch.Tensor):
            layout.buffers[key] = value
        else:
            raise ValueError(
                f"state_dict entry {key!r} is a {type(value).__name__} (get_extra_state?); "
                "flatshard checkpoints store tensors only: pass it through extra= instead"
            )
    return layout


def describe_model(layout: ModelLayout) -> dict:
    """The JSON description: full shapes and dtypes, aliases, key order."""
    return {
        "params": {
            n: {"shape": list(p.shape), "dtype": _dtype_name(p.fragment.dtype), "numel": p.numel}
            for n, p in layout.params.items()
        },
        "buffers": {
            n: {"shape": list(b.shape), "dtype": _dtype_name(b.dtype)}
            for n, b in layout.buffers.items()
        },
        "aliases": layout.aliases,
        "keys": layout.keys,
    }


def model_items(layout: ModelLayout) -> dict[str, Item]:
    """Every state_dict key's DCP item. A tied parameter is written under each of its names,
    as torch's DCP does (``get_model_state_dict`` asks for every key); flatshard reads the
    first and records the others as aliases."""
    items: dict[str, Item] = {n: p.item(p.fragment.detach()) for n, p in layout.params.items()}
    items.update({alias: items[source] for alias, source in layout.aliases.items()})
    items.update({n: b.detach() for n, b in layout.buffers.items()})
    return items


def optimizer_params(optimizer: torch.optim.Optimizer, layout: ModelLayout) -> list[list[str]]:
    """Parameter names of each param group; ``ValueError`` for a tensor that is no fragment."""
    name_of = layout.name_of
    groups = []
    for gi, group in enumerate(optimizer.param_groups):
        names = []
        for p in group["params"]:
            if id(p) not in name_of:
                raise ValueError(
                    f"optimizer param group {gi} holds a tensor of shape {tuple(p.shape)} that "
                    "is not a parameter of this sharded model; build the optimizer from "
                    "model.parameters() after fs.shard(model)"
                )
            names.append(name_of[id(p)])
        groups.append(names)
    return groups


def optimizer_entries(
    optimizer: torch.optim.Optimizer, layout: ModelLayout, flat_groups: bool = False
) -> tuple[dict[str, Item], dict]:
    """DCP items and the JSON description of ``optimizer``'s state, keyed by parameter name.
    ``flat_groups``: the param groups' DCP copies under torch's flattened keys
    (``optimizer.param_groups.<name>.<hyper>``), which do not collide between the optimizers
    of pipeline stages ([Note: checkpoints across pipeline stages] in parts.py)."""
    names = optimizer_params(optimizer, layout)
    items: dict[str, Item] = {}
    state_desc: dict[str, dict] = {}
    aliases_of: dict[str, list[str]] = {}
    for alias, source in layout.aliases.items():
        aliases_of.setdefault(source, []).append(alias)
    for group, group_names in zip(optimizer.param_groups, names, strict=True):
        for p, name in zip(group["params"], group_names, strict=True):
            info = layout.params[name]
            entries = {}
            for key, value in optimizer.state.get(p, {}).items():
                # under every name of a tied parameter, as model_items does: a stage holding
                # only the other name (lm_head of a pipeline's last stage) reads its own key
                fqns = [optim_key(n, key) for n in (name, *aliases_of.get(name, ()))]
                if isinstance(value, torch.Tensor) and value.shape == p.shape:
                    items.update(dict.fromkeys(fqns, info.item(value.detach())))
                    entries[key] = {"kind": "sharded"}
                elif isinstance(value, torch.Tensor):
                    items.update(dict.fromkeys(fqns, value.detach()))
                    entries[key] = {"kind": "tensor"}
                else:
                    entries[key] = {"kind": "value", "value": jsonable.encode(value, fqns[0])}
            if entries:
                state_desc[name] = entries
    param_groups = [
        {"params": group_names, "hyper": jsonable.encode(_hyper(group), f"param group {gi}")}
        for gi, (group, group_names) in enumerate(zip(optimizer.param_groups, names, strict=True))
    ]
    for gi, (group, group_names) in enumerate(zip(optimizer.param_groups, names, strict=True)):
        if flat_groups:
            for name in group_names:
                for hyper, value in _hyper(group).items():
                    items[f"{OPTIM_PREFIX}param_groups.{name}.{hyper}"] = Pickled(value)
            continue
        for hyper, value in {**_hyper(group), "params": list(group_names)}.items():
            items[f"{OPTIM_PREFIX}param_groups.{gi}.{hyper}"] = Pickled(value)
    desc = {"class": type(optimizer).__name__, "param_groups": param_groups, "state": state_desc}
    return items, desc


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"checkpoint names an unknown dtype {name!r}")
    return dtype
