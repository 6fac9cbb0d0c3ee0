"""``fs.load``: verify, check against the model, then let DCP reshard into the new layout.

Before any tensor is read, every rank checks the manifest, the description and the DCP metadata
(with the restricted unpickler, see safety.py), and the sha256 of its share of the data files
(rank r hashes files r, r+W, ...: each file is hashed once in total). The ranks then agree on
the first problem found anywhere, so a damaged or foreign checkpoint raises the same
``ValueError`` on every rank and nothing is half-loaded.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from ..engine.state import get_state
from . import agree, commit, jsonable, restore, safety
from .layout import ModelLayout, model_layout
from .planner import FlatLoadPlanner, VerifiedReader
from .saver import session_of

PICKLED = "optimizer.param_groups."  # the only entries of ours that are not tensors


@dataclass
class Opened:
    """A checkpoint whose manifest, description and metadata were read and validated."""

    path: Path
    files: dict[str, dict]  # manifest: name -> {"bytes", "sha256"}
    description: dict
    metadata: Metadata

    @property
    def version(self) -> int:
        """The checkpoint format version (see ``commit.READABLE_VERSIONS``)."""
        return int(self.description.get("version", 1))

    @property
    def data_files(self) -> list[str]:
        return sorted(n for n in self.files if n.endswith(".distcp"))


def open_checkpoint(path: str | os.PathLike) -> Opened:
    """Read and validate everything but the tensor data; ``ValueError`` says what is wrong."""
    path = Path(path)
    files = commit.read_manifest(path)["files"]
    for name in (commit.DESCRIPTION, commit.DCP_METADATA):
        if name not in files:
            raise ValueError(f"{path / commit.MANIFEST} does not list {name}; damaged checkpoint")
        if problem := safety.file_problem(path, name, files[name]):
            raise ValueError(problem)
    try:
        description = json.loads((path / commit.DESCRIPTION).read_text(encoding="utf-8"))
        if description.get("format") != commit.FORMAT:
            raise ValueError("not a flatshard description")
        restore.check_dtypes(description["model"])
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{path / commit.DESCRIPTION} is malformed ({err})") from None
    data = {n for n in files if n.endswith(".distcp")}
    # the optimizer's param groups are pickled for torch's tools (never read here)
    metadata = safety.read_metadata(path / commit.DCP_METADATA, data, allow_objects=PICKLED)
    return Opened(path, files, description, metadata)


def verify_files(opened: Opened, names: list[str]) -> str | None:
    """The first data file among ``names`` whose size or sha256 differs from the manifest."""
    for name in names:
        if problem := safety.file_problem(opened.path, name, opened.files[name]):
            return problem + "; restore it from a copy or load an earlier checkpoint"
    return None


def read_tensors(opened: Opened, targets: dict, group: dist.ProcessGroup | None) -> None:
    """Let DCP fill ``targets`` from the checkpoint (``group=None``: this process alone)."""
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # no_dist=True warns that "torch.distributed is disabled": that is the intent.
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(
                targets,
                storage_reader=VerifiedReader(str(opened.path), opened.metadata),
                planner=FlatLoadPlanner(),
                process_group=group,
                no_dist=group is None,
            )
    except CheckpointException as err:
        raise agree.dcp_error(err, f"reading the tensors of {opened.path}") from None


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
