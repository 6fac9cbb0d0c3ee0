"""``fs.load``: verify, check against the model, then let DCP reshard into the new layout.

Before any tensor is read, every rank checks the manifest, the description and the DCP metadata
(with the restricted unpickler, see safety.py), and the sha256 of its share of the data files
(rank r hashes files r, r+W, ...: each file is hashed once in total). The ranks then agree on
the first problem found anywhere, so a damaged or foreign checkpoint raises the same
``ValueError`` on every rank and nothing is half-loaded.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..engine.state import get_state
from . import agree, commit, jsonable, restore
from .layout import ModelLayout, model_layout
from .reading import Opened, open_checkpoint, read_tensors, verify_files
from .saver import session_of


def _problem(
    opened: Opened,
    layout: ModelLayout,
    optimizer: torch.optim.Optimizer | None,
    strict: bool,
    share: tuple[int, int],
) -> str | None:
    rank, world = share
    desc = opened.description
    try:
        problem = restore.model_problem(desc["model"], layout, opened.metadata, strict)
        if problem is None and optimizer is not None:
            problem = restore.optimizer_problem(desc.get("optimizer"), optimizer, layout)
    except (KeyError, TypeError, AttributeError) as err:
        return f"{opened.path / commit.DESCRIPTION} is malformed ({err!r})"
    if problem is not None:
        return f"{opened.path}: {problem}"
    return verify_files(opened, opened.data_files[rank::world])


def load(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = True,
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
    """
    state = get_state(model)
    session_of(model).wait_pending()
    from . import (
        foreign,  # it builds on this module
        sliced,
    )

    if Path(path).is_file() or sliced.is_pretrained_dir(Path(path)):  # weights only
        extra = _load_weights(Path(path), model, optimizer, strict)
        state.reshard_all()
        return extra
    if foreign.is_foreign(Path(path)):  # torch FSDP2 / torchtitan / Accelerate (DCP) directories
        extra = foreign.load_foreign(Path(path), model, optimizer)
        state.reshard_all()
        return extra
    group = agree.model_group(model)
    layout = model_layout(model)
    share = (dist.get_rank(group), dist.get_world_size(group))
    opened, error = None, None
    try:
        opened = open_checkpoint(path)
        error = _problem(opened, layout, optimizer, strict, share)
    except ValueError as err:
        error = str(err)
    agree.raise_if(agree.first_error(error, group))
    assert opened is not None
    targets = restore.model_targets(layout)
    optim_state = None
    if optimizer is not None:
        optim_desc = {**opened.description["optimizer"], "version": opened.version}
        optim_targets, optim_state = restore.optimizer_targets(optim_desc, layout, opened.metadata)
        targets.update(optim_targets)
    read_tensors(opened, targets, group)
    if optimizer is not None:
        restore.load_optimizer(optimizer, opened.description["optimizer"], layout, optim_state)
    state.reshard_all()
    return jsonable.decode(opened.description.get("extra", {}))


def _load_weights(path: Path, model: nn.Module, optimizer, strict: bool) -> dict:
    """Safetensors (a file or a save_pretrained directory): every rank reads its own slices;
    a torch.save file: rank 0 reads it and the shards are scattered."""
    if optimizer is not None:
        raise ValueError(
            f"fs.load({str(path)!r}, optimizer=...): weights hold no optimizer state; load "
            "them without optimizer= (or pass a checkpoint directory)"
        )
    from . import sliced
    from .full_file import load_full_state_dict_from_file

    if path.is_dir() or path.suffix == ".safetensors":
        return sliced.load_sliced(path, model)
    load_full_state_dict_from_file(path, model=model, strict=strict)
    return {}
