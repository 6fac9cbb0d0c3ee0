"""``fs.load`` on DCP directories other tools wrote: torch FSDP2/DDP, torchtitan, Accelerate.

They are plain DCP checkpoints (``.metadata`` + ``*.distcp``, no flatshard manifest) of full-
shape tensors, under torch's state-dict conventions:

- model entries under their FQNs, at the top level (torchtitan, ``dcp.save(model_sd)``) or
  under ``model.`` (``dcp.save({"model": get_model_state_dict(m), ...})``);
- optimizer state as ``get_optimizer_state_dict`` flattens it: ``optimizer.state.<fqn>.<key>``
  (``exp_avg``, ``exp_avg_sq``, ``step``, ...), hyperparameters as pickled
  ``optimizer.param_groups.<fqn>.<name>`` entries, which are never unpickled here (the
  optimizer keeps the hyperparameters it was built with);
- Accelerate's SHARDED_STATE_DICT directory: the model in ``pytorch_model_fsdp_0/`` and the
  optimizer in ``optimizer_0/``, each such a checkpoint.

There are no checksums to verify: the load warns and goes on. The metadata is still read with
the restricted unpickler, and every parameter is read as the rectangles of its full shape that
this rank's fragment covers (``planner.py``), whatever world size and sharding wrote it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from flatshard.checkpoint import agree, commit, safety
from flatshard.checkpoint.contents import ModelLayout, model_layout, optimizer_params
from flatshard.checkpoint.planner import Item, Sharded
from flatshard.checkpoint.reading import Opened, read_tensors

DCP_METADATA = ".metadata"
ACCELERATE_MODEL, ACCELERATE_OPTIM = "pytorch_model_fsdp_0", "optimizer_0"
OPTIM_STATE = "optimizer.state."
MODEL_PREFIXES = ("", "model.")


def is_foreign(path: Path) -> bool:
    """A DCP directory without flatshard's manifest (or an Accelerate SHARDED directory)."""
    if (path / commit.MANIFEST).exists():
        return False
    return (path / DCP_METADATA).is_file() or (path / ACCELERATE_MODEL / DCP_METADATA).is_file()


@dataclass
class Foreign:
    """The model and optimizer parts of a foreign checkpoint (the same directory, or not)."""

    model: Opened
    optimizer: Opened | None


def open_foreign(path: Path) -> Foreign:
    if (path / ACCELERATE_MODEL / DCP_METADATA).is_file():
        optim_dir = path / ACCELERATE_OPTIM
        optim = _open(optim_dir) if (optim_dir / DCP_METADATA).is_file() else None
        return Foreign(_open(path / ACCELERATE_MODEL), optim)
    opened = _open(path)
    return Foreign(opened, opened)


def _open(path: Path) -> Opened:
    files = {p.name for p in path.glob("*.distcp")}
    metadata = safety.read_metadata(path / DCP_METADATA, files, allow_objects=True)
    return Opened(path, {}, {}, metadata)


def model_prefix(metadata: Metadata, layout: ModelLayout) -> str:
    """Where the model's entries are: at the top level or under ``model.``."""
    names = [*layout.params, *layout.buffers]
    entries = metadata.state_dict_metadata
    for prefix in MODEL_PREFIXES:
        if all(prefix + n in entries for n in layout.params):
            return prefix
    found = sorted(k for k in entries if not k.startswith("optimizer."))[:5]
    raise ValueError(
        f"found none of the model's entries (e.g. {names[:3]}) at the top level or under "
        f"'model.' (the checkpoint has e.g. {found}); is it a checkpoint of this model?"
    )


def model_targets(metadata: Metadata, layout: ModelLayout, prefix: str) -> dict[str, Item]:
    """Read targets for every parameter (this rank's rectangles) and buffer present."""
    targets: dict[str, Item] = {}
    for name, p in layout.params.items():
        _check_shape(metadata, prefix + name, p.shape)
        targets[prefix + name] = p.item(p.fragment.detach())
    for name, buf in layout.buffers.items():
        if prefix + name in metadata.state_dict_metadata:  # non-persistent ones may be absent
            _check_shape(metadata, prefix + name, buf.shape)
            targets[prefix + name] = buf.detach()
    return targets


def _check_shape(metadata: Metadata, key: str, shape: torch.Size) -> None:
    md = metadata.state_dict_metadata.get(key)
    if not isinstance(md, TensorStorageMetadata):
        raise ValueError(f"checkpoint entry {key!r} is missing (or not a tensor)")
    if tuple(md.size) != tuple(shape):
        raise ValueError(f"{key!r} has shape {list(md.size)} in the checkpoint, {list(shape)} here")


def optimizer_targets(
    metadata: Metadata, layout: ModelLayout, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Item], dict[str, dict]]:
    """Read targets for ``optimizer.state.<name>.<key>`` of every parameter the optimizer
    holds: full-shape state as this rank's rectangles, anything else (``step``) whole."""
    targets: dict[str, Item] = {}
    state: dict[str, dict] = {}
    names = {n for group in optimizer_params(optimizer, layout) for n in group}
    for key, md in metadata.state_dict_metadata.items():
        if not key.startswith(OPTIM_STATE) or not isinstance(md, TensorStorageMetadata):
            continue
        name, _, state_key = key[len(OPTIM_STATE) :].rpartition(".")
        if name not in names:
            continue
        info = layout.params[name]
        if tuple(md.size) == tuple(info.shape) and state_key != "step":  # sharded like the param
            local = torch.empty(info.fragment.numel(), dtype=md.properties.dtype)
            local = local.to(info.fragment.device)
            targets[key] = info.item(local)
        else:
            targets[key] = torch.empty(md.size, dtype=md.properties.dtype)
        state.setdefault(name, {})[state_key] = targets[key]
    if not state:
        raise ValueError(
            "the checkpoint holds no optimizer state for these parameters (no "
            "'optimizer.state.<name>.<key>' entries); load without optimizer="
        )
    return targets, state


def apply_optimizer_state(
    optimizer: torch.optim.Optimizer, layout: ModelLayout, state: dict[str, dict]
) -> None:
    """Hand the loaded tensors to ``optimizer.load_state_dict``; hyperparameters stay."""
    names = optimizer_params(optimizer, layout)
    index = {n: i for i, n in enumerate(n for group in names for n in group)}
    current = optimizer.state_dict()
    loaded = {
        index[name]: {k: (v.local if isinstance(v, Sharded) else v) for k, v in entries.items()}
        for name, entries in state.items()
    }
    optimizer.load_state_dict({"state": loaded, "param_groups": current["param_groups"]})


def load_foreign(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """Load a foreign DCP checkpoint into the sharded ``model`` (and ``optimizer``)."""
    group = agree.model_group(model)
    layout = model_layout(model)
    plan, error = None, None
    try:
        plan = _plan(path, layout, optimizer)
    except ValueError as err:
        error = f"{path}: {err}"
    agree.raise_if(agree.first_error(error, group))
    assert plan is not None
    foreign, model_reads, optim_reads, optim_state = plan
    warnings.warn(
        f"{path} is not a flatshard checkpoint (no {commit.MANIFEST}): loading it as a plain "
        "DCP checkpoint, without checksums to verify",
        stacklevel=3,
    )
    read_tensors(foreign.model, model_reads, group)
    if optimizer is not None:
        assert foreign.optimizer is not None
        read_tensors(foreign.optimizer, optim_reads, group)
        apply_optimizer_state(optimizer, layout, optim_state)
    return {}


def _plan(path: Path, layout: ModelLayout, optimizer: torch.optim.Optimizer | None):
    foreign = open_foreign(path)
    prefix = model_prefix(foreign.model.metadata, layout)
    model_reads = model_targets(foreign.model.metadata, layout, prefix)
    optim_reads, optim_state = {}, {}
    if optimizer is not None:
        if foreign.optimizer is None:
            raise ValueError(f"no optimizer state next to the model ({ACCELERATE_OPTIM}/)")
        optim_reads, optim_state = optimizer_targets(foreign.optimizer.metadata, layout, optimizer)
    return foreign, model_reads, optim_reads, optim_state
