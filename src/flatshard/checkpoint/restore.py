"""Load side of contents.py: check a checkpoint against the model, build the DCP targets, and put
the loaded optimizer state back by parameter name.

Parameters and buffers are read straight into the fragments and buffers (DCP copies into
detached views, which share the shard's version counter, so a unit kept gathered sees that its
shard changed). Optimizer state tensors are read into fresh tensors laid out like the new
fragments and handed to ``optimizer.load_state_dict``, which applies the optimizer's own
casting rules.
"""

from __future__ import annotations

import json

import torch
from torch.distributed.checkpoint.metadata import Metadata

from flatshard.checkpoint import jsonable
from flatshard.checkpoint.contents import ModelLayout, dtype_from_name, optim_key, optimizer_params
from flatshard.checkpoint.planner import Item, Sharded


def model_problem(
    desc: dict,
    layout: ModelLayout,
    metadata: Metadata,
    strict: bool,
    covered: set[str] | None = None,
) -> str | None:
    """Why the checkpoint's model part does not fit ``layout`` (``None`` if it does).
    ``covered``: the names every stage of a pipeline holds (an entry is unexpected only if no
    stage holds it); ``None``: ``layout`` is the whole model."""
    saved = {**desc["params"], **desc["buffers"]}
    for alias, source in desc.get("aliases", {}).items():  # written under every tied name
        saved.setdefault(alias, saved.get(source))
    current = {n: list(p.shape) for n, p in layout.params.items()}
    current.update({n: list(b.shape) for n, b in layout.buffers.items()})
    missing = [n for n in current if saved.get(n) is None]
    held = set(current if covered is None else covered) | set(layout.aliases)
    unexpected = [n for n in saved if n not in held]
    if missing or (strict and unexpected):
        return (
            f"checkpoint does not match the model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}; load it into the architecture that saved it (strict=False "
            "ignores unexpected entries)"
        )
    for name, shape in current.items():
        if saved[name]["shape"] != shape:
            return f"{name!r} has shape {saved[name]['shape']} in the checkpoint, {shape} here"
        numel = saved[name].get("numel", 1)
        if numel and name not in metadata.state_dict_metadata:
            return f"{name!r} is described but has no data in the DCP metadata"
    return None


def model_targets(layout: ModelLayout) -> dict[str, Item]:
    targets: dict[str, Item] = {n: p.item(p.fragment.detach()) for n, p in layout.params.items()}
    targets.update({n: b.detach() for n, b in layout.buffers.items()})
    return targets


def optimizer_problem(
    desc: dict | None, optimizer: torch.optim.Optimizer, layout: ModelLayout, by_param: bool
) -> str | None:
    """Why ``optimizer`` cannot take the saved state (``None`` if it can). ``by_param``: match
    param groups by parameter (a checkpoint of, or loaded into, pipeline stages: see
    [Note: checkpoints across pipeline stages]), else by position."""
    if desc is None:
        return "the checkpoint has no optimizer state (saved without optimizer=)"
    names = optimizer_params(optimizer, layout)
    if by_param or desc.get("by_param"):
        return _group_by_param_problem(desc, names)
    saved = [g["params"] for g in desc["param_groups"]]
    if len(saved) != len(names):
        return (
            f"the checkpoint's optimizer has {len(saved)} param groups, this one "
            f"{len(names)}; build the optimizer with the same groups"
        )
    for gi, (want, have) in enumerate(zip(saved, names, strict=True)):
        if set(want) != set(have):
            diff = sorted(set(want) ^ set(have))[:5]
            return f"param group {gi} holds other parameters than when saved (differ: {diff})"
    return None


def saved_hyper(desc: dict) -> dict[str, str]:
    """Each saved parameter's group hyperparameters (as JSON text, comparable), also under
    the other names of a tied parameter (``desc["aliases"]``, from the model's description)."""
    hyper = {
        name: json.dumps(group["hyper"], sort_keys=True)
        for group in desc["param_groups"]
        for name in group["params"]
    }
    for alias, source in desc.get("aliases", {}).items():
        if source in hyper:
            hyper.setdefault(alias, hyper[source])
    return hyper


def saved_state_name(name: str, desc: dict) -> str | None:
    """The name ``name``'s optimizer state was saved under: its own, or (a tied parameter's
    other name) its source's; ``None`` if it has none."""
    if name in desc["state"]:
        return name
    source = desc.get("aliases", {}).get(name)
    return source if source in desc["state"] else None


def _group_by_param_problem(desc: dict, names: list[list[str]]) -> str | None:
    hyper = saved_hyper(desc)
    for gi, group in enumerate(names):
        missing = [n for n in group if n not in hyper]
        if missing:
            return (
                f"param group {gi} holds parameters the checkpoint's optimizer never held "
                f"({missing[:5]}); build the optimizer over the parameters that were saved"
            )
        if len({hyper[n] for n in group}) > 1:
            return (
                f"param group {gi} mixes parameters saved with different hyperparameters; "
                "group them as they were grouped when saved"
            )
    return None


def optimizer_targets(
    desc: dict, layout: ModelLayout, metadata: Metadata, names: set[str] | None = None
) -> tuple[dict[str, Item], dict[str, dict]]:
    """DCP targets for the sharded/replicated state tensors, and per parameter the state dict
    to rebuild (tensor entries filled after the load, values decoded now). ``names``: only
    these parameters' state (one optimizer of several model parts)."""
    targets: dict[str, Item] = {}
    state: dict[str, dict] = {}
    version = desc.get("version", 2)  # set by optimizer_targets' caller from the description
    wanted = desc["state"] if names is None else sorted(names)  # a stage: its own parameters
    for name in wanted:
        source = saved_state_name(name, desc)
        if source is None:
            continue  # never stepped when saved
        entries = desc["state"][source]
        info = layout.params[name]
        state[name] = {}
        for key, entry in entries.items():
            fqn = optim_key(name, key, version)
            if entry["kind"] == "value":
                state[name][key] = jsonable.decode(entry["value"])
                continue
            md = metadata.state_dict_metadata.get(fqn)
            if md is None:
                if entry["kind"] == "sharded" and info.numel == 0:
                    state[name][key] = torch.empty(0, dtype=info.fragment.dtype)
                    continue
                raise ValueError(f"optimizer state {fqn!r} is described but has no data")
            if entry["kind"] == "sharded":
                local = torch.empty(info.fragment.numel(), dtype=md.properties.dtype)
                local = local.to(info.fragment.device)
                targets[fqn] = info.item(local)
            else:
                targets[fqn] = torch.empty(md.size, dtype=md.properties.dtype)
            state[name][key] = targets[fqn]
    return targets, state


def load_optimizer(
    optimizer: torch.optim.Optimizer,
    desc: dict,
    layout: ModelLayout,
    state: dict[str, dict],
    by_param: bool = False,
) -> None:
    """Hand the loaded state to ``optimizer.load_state_dict`` in its own (positional) format;
    ``by_param``: each group's hyperparameters are those its parameters were saved with."""
    names = optimizer_params(optimizer, layout)
    by_name = {g_names_i: i for i, g_names_i in enumerate(n for g in names for n in g)}
    if by_param or desc.get("by_param"):
        hyper = saved_hyper(desc)  # an empty group keeps its own hyperparameters
        saved = [jsonable.decode(json.loads(hyper[g[0]])) if g else None for g in names]
    else:
        saved = [jsonable.decode(g["hyper"]) for g in desc["param_groups"]]
    groups = []
    for gi, (group, hyper) in enumerate(zip(names, saved, strict=True)):
        if hyper is None:
            hyper = {k: v for k, v in optimizer.param_groups[gi].items() if k != "params"}
        groups.append({**hyper, "params": [by_name[n] for n in group]})
    unwrapped = {
        by_name[name]: {k: (v.local if isinstance(v, Sharded) else v) for k, v in entries.items()}
        for name, entries in state.items()
        if name in by_name
    }
    optimizer.load_state_dict({"state": unwrapped, "param_groups": groups})


def check_dtypes(desc: dict) -> None:
    """Resolve every dtype name early (a crafted description fails here, clearly)."""
    for section in ("params", "buffers"):
        for entry in desc[section].values():
            dtype_from_name(entry["dtype"])
