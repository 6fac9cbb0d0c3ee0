"""Pretrained weights into a sharded model, each rank reading only its own fragments.

``fs.load`` on a ``save_pretrained`` directory (``model.safetensors``, or the indexed
``model-0000k-of-0000N.safetensors`` files) or on a ``.safetensors`` file: every rank opens the
files (memory-mapped) and, per parameter, reads the rows that cover its fragment through a
safetensors slice. No rank builds the full model: host memory is the shard plus one slice.
(A ``torch.save`` file cannot be sliced: it goes through rank 0, see ``full_file.py``.)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..params import fragment_tag
from . import agree
from .layout import ModelLayout, model_layout

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def is_pretrained_dir(path: Path) -> bool:
    return path.is_dir() and ((path / INDEX).is_file() or (path / SINGLE).is_file())


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it."""
    if path.is_file():
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return dict.fromkeys(f.keys(), path)
    if (path / INDEX).is_file():
        index = json.loads((path / INDEX).read_text())
        return {name: path / file for name, file in index["weight_map"].items()}
    return _weight_files(path / SINGLE)


def _sources(layout: ModelLayout, files: dict[str, Path]) -> tuple[dict[str, str], list[str]]:
    """Per state-dict entry to fill, the stored name to read it from (any name of a tied
    group will do); and the entries that have none."""
    names = {source: [source] for source in layout.params}
    for alias, source in layout.aliases.items():
        names[source].append(alias)
    sources, missing = {}, []
    for source, group in names.items():
        found = [n for n in group if n in files]
        if found:
            sources[source] = found[0]
        else:
            missing.append(source)
    for name in layout.buffers:
        if name in files:
            sources[name] = name
    return sources, missing


class _Files:
    """Open safetensors handles, one per file, for the duration of the load."""

    def __init__(self) -> None:
        self._open: dict[Path, object] = {}

    def slice(self, file: Path, name: str):
        from safetensors import safe_open

        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="pt", device="cpu")
        return self._open[file].get_slice(name)  # type: ignore[attr-defined]


def _read_fragment(handle, shape: torch.Size, flat_range: tuple[int, int]) -> torch.Tensor:
    """Elements ``[start, end)`` of the flattened tensor, reading only the rows covering them."""
    start, end = flat_range
    if len(shape) == 0:
        return handle[:].reshape(-1)[start:end]
    row = math.prod(shape[1:])
    first, last = start // row, -(-end // row)
    rows = handle[first:last].reshape(-1)
    return rows[start - first * row : end - first * row]


def _check(layout: ModelLayout, files: dict[str, Path], sources: dict[str, str], opened) -> None:
    for name, stored in sources.items():
        want = layout.params[name].shape if name in layout.params else layout.buffers[name].shape
        have = tuple(opened.slice(files[stored], stored).get_shape())
        if have != tuple(want):
            raise ValueError(f"{stored!r} has shape {list(have)} in the file, {list(want)} here")


@torch.no_grad()
def load_sliced(path: Path, model: nn.Module) -> dict:
    """Fill ``model``'s fragments (and buffers) from safetensors files, each rank its own."""
    layout = model_layout(model)
    opened, error = _Files(), None
    try:
        files = _weight_files(path)
        sources, missing = _sources(layout, files)
        if missing:
            raise ValueError(f"lacks {missing[:5]}; pass the weights of this architecture")
        _check(layout, files, sources, opened)
    except (OSError, ValueError, KeyError) as err:
        error = f"cannot load {path}: {err}"
    agree.raise_if(agree.first_error(error, agree.world()))
    for name, p in layout.params.items():
        tag = fragment_tag(p.fragment)
        if p.fragment.numel():
            handle = opened.slice(files[sources[name]], sources[name])
            p.fragment.copy_(_read_fragment(handle, p.shape, tag.flat_range))
    for name, buf in layout.buffers.items():
        if name in sources:
            buf.copy_(opened.slice(files[name], name)[:])
    if dist.is_initialized():
        dist.barrier(agree.world())  # nobody trains on half-loaded weights
    return {}
