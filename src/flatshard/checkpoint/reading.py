"""Opening a flatshard checkpoint and reading its tensors, shared by ``fs.load``, the exports
and the foreign-format loader (kept apart from loader.py so that none of them imports another).

``open_checkpoint`` reads and validates the manifest, the description and the DCP metadata
(with the restricted unpickler, see safety.py), but no tensor data; ``verify_files`` checks
data files against the manifest; ``read_tensors`` lets DCP fill targets through the verifying
reader.
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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from flatshard.checkpoint import agree, commit, restore, safety
from flatshard.checkpoint.planner import FlatLoadPlanner, VerifiedReader

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
