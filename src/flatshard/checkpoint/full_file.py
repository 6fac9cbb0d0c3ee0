"""Start sharded training from one full state-dict file (safetensors or ``torch.save``).

Rank 0 opens the file lazily (safetensors: memory-mapped ``safe_open``; a torch file:
``torch.load(weights_only=True, mmap=True)``) and hands ``fs.load_full_state_dict`` a mapping
whose tensors are read on access. That function fills and broadcasts one flat group at a time,
so every rank holds at most one unit's full parameters beyond its shards. Tied parameters may be
stored under any of their names (Hugging Face files often keep only one).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from flatshard.checkpoint import agree
from flatshard.checkpoint.contents import model_layout
from flatshard.checkpoint.full_state import load_full_state_dict
from flatshard.core.state import get_state


class FileTensors(Mapping):
    """A read-on-access ``{name: tensor}`` view of a state-dict file."""

    def __init__(self, path: Path, aliases: dict[str, list[str]]) -> None:
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic == b"PK\x03\x04":  # torch.save's zip format
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            if not isinstance(sd, Mapping) or not all(torch.is_tensor(v) for v in sd.values()):
                raise ValueError(f"{path} is not a flat state dict of tensors")
            self._get, names = sd.__getitem__, list(sd)
            self._shape = {k: tuple(v.shape) for k, v in sd.items()}
        else:
            from safetensors import safe_open

            handle = safe_open(str(path), framework="pt", device="cpu")
            self._handle = handle  # keeps the memory map open while we read
            names = list(handle.keys())
            self._get = handle.get_tensor
            self._shape = {k: tuple(handle.get_slice(k).get_shape()) for k in names}
        self._names = names
        # Any stored name of a tied parameter serves all of its names.
        self._source = {n: n for n in names}
        for group in aliases.values():
            present = [n for n in group if n in self._shape]
            for n in group:
                if n not in self._source and present:
                    self._source[n] = present[0]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._get(self._source[key])

    def __contains__(self, key: object) -> bool:
        return key in self._source

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shape[self._source[key]]


def _tie_groups(model: nn.Module) -> dict[str, list[str]]:
    layout = model_layout(model)
    groups: dict[str, list[str]] = {}
    for alias, source in layout.aliases.items():
        groups.setdefault(source, [source]).append(alias)
    return groups


def _open(path: Path, model: nn.Module) -> tuple[FileTensors | None, str | None]:
    """Rank 0: open the file and compare its shapes with the model's."""
    try:
        tensors = FileTensors(path, _tie_groups(model))
    except Exception as err:  # a missing, foreign or damaged file: tell every rank
        return None, f"cannot read {path} as a safetensors or torch state-dict file: {err}"
    refs = model_layout(model)
    shapes = {n: tuple(p.shape) for n, p in refs.params.items()}
    shapes.update({n: tuple(b.shape) for n, b in refs.buffers.items()})
    for name, shape in shapes.items():
        if name in tensors and tensors.shape(name) != shape:
            return None, f"{path}: {name!r} has shape {tensors.shape(name)}, the model {shape}"
    missing = [k for k in refs.keys if k not in tensors]
    if missing:  # every shard needs a source, strict or not
        return None, f"{path} lacks {missing[:5]}; pass the state dict of this architecture"
    return tensors, None


def load_full_state_dict_from_file(
    path: str | os.PathLike | nn.Module,
    legacy_path: str | os.PathLike | None = None,
    *,
    model: nn.Module | None = None,
    strict: bool = True,
) -> None:
    """Load a full (unsharded) state-dict file into the sharded ``model``, streaming:
    ``load_full_state_dict_from_file(path, model=model)``, path first like ``fs.load``.

    Every rank must call it; only rank 0 reads ``path`` (other ranks need not see it). Keys
    and shapes are checked first and a mismatch raises the same ``ValueError`` on every rank.
    The old order ``(model, path)`` still works, with a ``DeprecationWarning``.
    """
    if isinstance(path, nn.Module):
        warnings.warn(
            "load_full_state_dict_from_file(model, path) is deprecated: write "
            "load_full_state_dict_from_file(path, model=model) (path first, like fs.load)",
            DeprecationWarning,
            stacklevel=2,
        )
        path, model = legacy_path, path  # type: ignore[assignment]
    if model is None or path is None:
        raise TypeError("load_full_state_dict_from_file(path, model=...) needs both")
    get_state(model)  # a clear error if the model is not sharded
    group = agree.model_group(model)  # load_full_state_dict's source: the mesh's first rank
    tensors, error = None, None
    if dist.get_rank(group) == 0:
        tensors, error = _open(Path(path), model)
    agree.raise_if(agree.from_rank0(error, group))
    load_full_state_dict(model, tensors if tensors is not None else {}, strict=strict)
