"""Loading untrusted checkpoints: a restricted unpickler for DCP's ``.metadata`` and checksums.

[Note: what is unpickled, and how]
A DCP checkpoint has two kinds of pickles. ``.metadata`` is a plain pickle that DCP would load
with ``pickle.load`` (arbitrary code execution); we read it with ``SafeUnpickler``, whose
``find_class`` resolves only DCP's own metadata dataclasses and a few harmless torch/pathlib
names, so a crafted file fails with ``ValueError`` before any of its code runs. The ``.distcp``
files are ``torch.save`` archives of single tensors; DCP's reader opens them with
``torch.load(weights_only=True)``, and our load planner refuses ``BYTE_IO`` entries, the only
kind DCP would unpickle freely. Our own files (``flatshard.json``, ``MANIFEST.json``) are JSON.
"""

from __future__ import annotations

import hashlib
import io
import math
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {(_DCP_METADATA, name) for name in ("Metadata", "TensorStorageMetadata", "TensorProperties")}
    | {(_DCP_METADATA, "BytesStorageMetadata")}  # described only; refused unless allowed
    | {(_DCP_METADATA, name) for name in ("ChunkStorageMetadata", "MetadataIndex", "StorageMeta")}
    | {
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a lookup in a dict of torch.layout values
        ("collections", "OrderedDict"),
    }
    | {("pathlib", name) for name in ("PosixPath", "PurePosixPath", "WindowsPath")}
    | {("pathlib", "PureWindowsPath")}
)
HASH_CHUNK = 1 << 20


class SafeUnpickler(pickle.Unpickler):
    """Resolves only the names in ``ALLOWED_GLOBALS`` and torch dtypes/layouts."""

    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.layout):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed")


def read_metadata(path: Path, files: set[str], *, allow_objects: bool | str = False) -> Metadata:
    """Unpickle and validate ``path`` (DCP ``.metadata``) without running foreign code.

    ``files`` are the data files the manifest lists; every storage reference must point into
    them, so a crafted metadata cannot make the reader open arbitrary paths.
    ``allow_objects``: pickled entries (optimizer hyperparameters, a train state) may be
    listed, and are never read: ``True`` for any key, a string for keys with that prefix."""
    try:
        metadata = SafeUnpickler(io.BytesIO(path.read_bytes())).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as err:
        raise ValueError(
            f"refusing to load {path}: it is not plain DCP metadata ({err}); a checkpoint may "
            "only contain DCP's own metadata classes. Do not load checkpoints from sources "
            "you do not trust with other tools"
        ) from None
    problem = _metadata_problem(metadata, files, allow_objects)
    if problem:
        raise ValueError(f"refusing to load {path}: {problem}")
    return metadata


def _metadata_problem(metadata: object, files: set[str], allow_objects: bool | str) -> str | None:
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        return f"expected DCP Metadata, found {type(metadata).__name__}"
    for key, md in metadata.state_dict_metadata.items():
        allowed = allow_objects is True or (allow_objects and key.startswith(allow_objects))
        if allowed and isinstance(md, BytesStorageMetadata):
            continue
        if not isinstance(md, TensorStorageMetadata):
            return f"entry {key!r} is a pickled object ({type(md).__name__}), not a tensor"
        volume = sum(math.prod(c.sizes) for c in md.chunks)
        if volume != math.prod(md.size):
            return f"entry {key!r}: its chunks cover {volume} of {math.prod(md.size)} elements"
    if not isinstance(metadata.storage_data, dict):
        return "storage_data is missing"
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            return "storage_data holds unexpected objects"
        if info.relative_path not in files or info.transform_descriptors:
            return f"entry {index.fqn!r} points to {info.relative_path!r}, not a listed data file"
    return None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def describe_file(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def file_problem(root: Path, name: str, expected: dict) -> str | None:
    """Why ``root/name`` does not match its manifest entry (``None`` if it does)."""
    path = root / name
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != expected["bytes"]:
        return f"{path} has {size} bytes, the manifest says {expected['bytes']} (truncated?)"
    if sha256_file(path) != expected["sha256"]:
        return f"{path} is corrupted: its sha256 differs from the manifest's"
    return None
