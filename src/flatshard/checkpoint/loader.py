"""``fs.load``: verify, check against the model, then let DCP reshard into the new layout.

Before any tensor is read, every rank checks the manifest, the description and the DCP metadata
(with the restricted unpickler, see safety.py), and the sha256 of its share of the data files
(rank r hashes files r, r+W, ...: each file is hashed once in total). The ranks then agree on
the first problem found anywhere, so a damaged or foreign checkpoint raises the same
``ValueError`` on every rank and nothing is half-loaded.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from flatshard.checkpoint import agree, commit, jsonable, parts, residuals, restore
from flatshard.checkpoint.contents import ModelLayout, model_layout, optimizer_params
from flatshard.checkpoint.reading import Opened, open_checkpoint, read_tensors, verify_files
from flatshard.checkpoint.saver import session_of
from flatshard.core.state import get_state


def _problem(
    opened: Opened,
    layout: ModelLayout,
    optimizers: list[torch.optim.Optimizer],
    strict: bool,
    share: tuple[int, int],
    covered: set[str] | None,
) -> str | None:
    rank, world = share
    desc = opened.description
    by_param = covered is not None
    try:
        problem = restore.model_problem(desc["model"], layout, opened.metadata, strict, covered)
        for optimizer in optimizers:
            if problem is None:
                optim_desc = _optimizer_description(desc)
                problem = restore.optimizer_problem(optim_desc, optimizer, layout, by_param)
    except (KeyError, TypeError, AttributeError) as err:
        return f"{opened.path / commit.DESCRIPTION} is malformed ({err!r})"
    if problem is not None:
        return f"{opened.path}: {problem}"
    return verify_files(opened, opened.data_files[rank::world])


def load(
    path: str | os.PathLike,
    *,
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    strict: bool = True,
    across: dist.ProcessGroup | DeviceMesh | None = None,
):
    """Load a checkpoint written by ``fs.save`` into ``model`` (and ``optimizer``) at this
    world size and wrap plan, whatever they were at save time; returns the saved ``extra``.
    A DCP directory written by torch FSDP2/DDP, torchtitan or Accelerate (no flatshard
    manifest) is recognised and loaded too (with a warning: it has no checksums; see
    ``checkpoint/foreign.py``), returning ``{}``; so are weights alone: a ``save_pretrained``
    directory or a ``.safetensors`` file (every rank reads only its own slices) and a
    ``torch.save`` state-dict file (through rank 0).

    Every rank must call it. Optimizer state is matched by parameter name; the optimizer must
    have the same param groups (same parameters each) as the saving one; its hyperparameters
    (lr, ...) are restored. ``strict=False`` ignores checkpoint entries the model lacks.

    Pipeline stages: ``model`` may be this rank's stage modules (``optimizer`` one per stage)
    and ``across`` the pipeline's group or mesh, as for ``fs.save``; any flatshard checkpoint
    of the same model loads (saved with or without a pipeline), param groups matched by
    parameter ([Note: checkpoints across pipeline stages], parts.py).
    """
    models, optimizers = parts.model_parts(model, optimizer)
    for part in models:
        session_of(part).wait_pending()
    in_parts = len(models) > 1 or across is not None
    if not in_parts:
        other = _load_other_format(Path(path), models[0], optimizers[0], strict)
        if other is not None:
            return other
    elif Path(path).is_file() or _is_other_dir(Path(path)):
        raise ValueError(
            f"fs.load({str(path)!r}, across=...): pipeline stages load flatshard checkpoints "
            "only; load weights or foreign checkpoints into the whole model, then fs.save it"
        )
    group = parts.checkpoint_group(models, across)
    layout = parts.merged_layout(models) if in_parts else model_layout(models[0])
    covered = parts.names_everywhere(layout, group) if in_parts else None
    share = (dist.get_rank(group), dist.get_world_size(group))
    optimizers_given = [o for o in optimizers if o is not None]
    opened, error = None, None
    try:
        opened = open_checkpoint(path)
        error = _problem(opened, layout, optimizers_given, strict, share, covered)
    except ValueError as err:
        error = str(err)
    agree.raise_if(agree.first_error(error, group))
    assert opened is not None
    extra = _read_into(opened, layout, optimizers_given, group, in_parts, models)
    for part in models:
        get_state(part).reshard_all()
    return extra


def _read_into(
    opened: Opened, layout: ModelLayout, optimizers: list, group, by_param, models: list
) -> dict:
    """Read the model's and each optimizer's tensors (and error-feedback residuals) in one
    DCP load; returns ``extra``."""
    targets = restore.model_targets(layout)
    saved = opened.metadata.state_dict_metadata
    fed = residuals.load_targets(models, layout, saved, by_param)
    targets.update(fed)
    optim_desc = {**(_optimizer_description(opened.description) or {}), "version": opened.version}
    by_param = by_param or bool(optim_desc.get("by_param"))  # saved by pipeline stages
    states = []
    for optimizer in optimizers:
        names = {n for g in optimizer_params(optimizer, layout) for n in g} if by_param else None
        optim_targets, optim_state = restore.optimizer_targets(
            optim_desc, layout, opened.metadata, names
        )
        targets.update(optim_targets)
        states.append(optim_state)
    read_tensors(opened, targets, group)
    residuals.restore_loaded(models, layout, fed)
    for optimizer, optim_state in zip(optimizers, states, strict=True):
        restore.load_optimizer(optimizer, optim_desc, layout, optim_state, by_param)
    return jsonable.decode(opened.description.get("extra", {}))


def _optimizer_description(description: dict) -> dict | None:
    """The checkpoint's optimizer description with the model's tied-name aliases (a stage may
    hold a tied parameter under its other name: see restore.saved_state_name)."""
    optimizer = description.get("optimizer")
    if optimizer is None:
        return None
    return {**optimizer, "aliases": description["model"].get("aliases", {})}


def _is_other_dir(path: Path) -> bool:
    from flatshard.checkpoint import foreign, sliced  # they build on this module

    return sliced.is_pretrained_dir(path) or foreign.is_foreign(path)


def _load_other_format(path: Path, model: nn.Module, optimizer, strict: bool) -> dict | None:
    """Weights (a file or a save_pretrained directory) or a foreign DCP directory loaded into
    ``model``; ``None`` if ``path`` is a flatshard checkpoint."""
    from flatshard.checkpoint import foreign, sliced  # they build on this module

    state = get_state(model)
    if path.is_file() or sliced.is_pretrained_dir(path):  # weights only
        extra = _load_weights(path, model, optimizer, strict)
    elif foreign.is_foreign(path):  # torch FSDP2 / torchtitan / Accelerate (DCP) directories
        extra = foreign.load_foreign(path, model, optimizer)
    else:
        return None
    state.reshard_all()
    return extra


def _load_weights(path: Path, model: nn.Module, optimizer, strict: bool) -> dict:
    """Safetensors (a file or a save_pretrained directory): every rank reads its own slices;
    a torch.save file: rank 0 reads it and the shards are scattered."""
    if optimizer is not None:
        raise ValueError(
            f"fs.load({str(path)!r}, optimizer=...): weights hold no optimizer state; load "
            "them without optimizer= (or pass a checkpoint directory)"
        )
    from flatshard.checkpoint import sliced
    from flatshard.checkpoint.full_file import load_full_state_dict_from_file

    if path.is_dir() or path.suffix == ".safetensors":
        return sliced.load_sliced(path, model)
    load_full_state_dict_from_file(path, model=model, strict=strict)
    return {}
