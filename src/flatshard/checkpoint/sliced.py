"""Pretrained weights into a sharded model, each rank reading only its own fragments.

``fs.load`` on a ``save_pretrained`` directory (``model.safetensors``, or the indexed
``model-0000k-of-0000N.safetensors`` files) or on a ``.safetensors`` file: every rank parses the
files' JSON headers and, per parameter, reads the bytes of its fragment (a contiguous range of
the row-major tensor) with plain file reads (``seek`` + ``readinto``, on every platform),
straight into the fragment's storage when the dtypes match (else through one fragment-sized
temporary, then cast). No rank builds the full model, and nothing is memory-mapped: a mapping
would count every page read in the rank's resident memory until the file is closed (a second
shard), where ``read`` leaves them in the page cache. Host memory is the shard plus at most one
fragment (measured: ``bench/bench_pretrained_load.py``, docs/checkpoints.md; that page also
gives the time ``safe_open(...).get_slice`` took instead).
(A ``torch.save`` file cannot be sliced: it goes through rank 0, see ``full_file.py``.)

A name the files lack is read from the source a tied model maps it to, when the model declares
the mapping as transformers does (``_tied_weights_keys = {"lm_head.weight":
"model.embed_tokens.weight"}``): ``save_pretrained`` writes a tied matrix once, under its
source, and a model (or a pipeline stage) holding its own copy of the head reads that.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from flatshard.checkpoint import agree, safetensors_io
from flatshard.checkpoint.contents import ModelLayout, ParamInfo, model_layout
from flatshard.checkpoint.planner import rectangles
from flatshard.core.params import fragment_tag

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def is_pretrained_dir(path: Path) -> bool:
    return path.is_dir() and ((path / INDEX).is_file() or (path / SINGLE).is_file())


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it."""
    if path.is_file():
        with _Files() as files:
            return dict.fromkeys(files.names(path), path)
    if (path / INDEX).is_file():
        index = json.loads((path / INDEX).read_text())
        return {name: path / file for name, file in index["weight_map"].items()}
    return _weight_files(path / SINGLE)


def _tied_sources(model: nn.Module) -> dict[str, str]:
    """transformers' mapping of a tied name to its source (a dict since transformers 5; a
    list of names before, which names no source), unless the model's config unties them
    (transformers ties only under ``tie_word_embeddings``)."""
    keys = getattr(model, "_tied_weights_keys", None)
    config = getattr(model, "config", None)
    if not isinstance(keys, dict) or not getattr(config, "tie_word_embeddings", True):
        return {}
    return {str(k): str(v) for k, v in keys.items()}


def _sources(
    layout: ModelLayout, files: dict[str, Path], tied: dict[str, str] | None = None
) -> tuple[dict[str, str], list[str]]:
    """Per state-dict entry to fill, the stored name to read it from (any name of a tied
    group will do, then the source ``tied`` maps it to); and the entries that have none."""
    tied = tied or {}
    names = {source: [source] for source in layout.params}
    for alias, source in layout.aliases.items():
        names[source].append(alias)
    for group in names.values():
        group += [tied[n] for n in list(group) if n in tied]
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
    """Open safetensors files and their parsed headers, for the duration of the load."""

    def __init__(self) -> None:
        self._open: dict[Path, tuple] = {}  # file -> (binary file, header, offset of the data)

    def __enter__(self) -> _Files:
        return self

    def __exit__(self, *exc) -> None:
        for f, _, _ in self._open.values():
            f.close()
        self._open.clear()

    def _file(self, file: Path) -> tuple:
        if file not in self._open:
            f = open(file, "rb", buffering=0)  # noqa: SIM115 (closed by __exit__)
            try:
                header, data_start = safetensors_io.read_header(f, file)
            except BaseException:
                f.close()
                raise
            self._open[file] = (f, header, data_start)
        return self._open[file]

    def names(self, file: Path) -> list[str]:
        return [k for k in self._file(file)[1] if k != "__metadata__"]

    def entry(self, file: Path, name: str) -> tuple[torch.dtype, list[int], int]:
        """``name``'s dtype, shape and first byte in ``file`` (checked against the file)."""
        f, header, data_start = self._file(file)
        size = os.fstat(f.fileno()).st_size
        return safetensors_io.header_entry(header, name, file, data_start, size)

    def read(self, file: Path, name: str, start: int, out: torch.Tensor) -> None:
        """Fill ``out`` with elements ``[start, start + out.numel())`` of the flattened
        stored tensor, read from the file (through a host temporary when ``out`` is on
        another device, non-contiguous or of another dtype)."""
        dtype, _, first = self.entry(file, name)
        direct = out.dtype == dtype and out.is_contiguous() and out.device.type == "cpu"
        target = out.view(-1) if direct else torch.empty(out.numel(), dtype=dtype)
        offset = first + start * dtype.itemsize
        safetensors_io.read_into(self._file(file)[0], offset, target, file)
        if not direct:
            out.copy_(target.view(out.shape))


def _read_placed(opened: _Files, file: Path, stored: str, info: ParamInfo) -> None:
    """Fill the fragment of a parameter whose local block sits at ``info.origin`` of the
    stored global tensor: its rectangles (planner.py) read as runs of contiguous elements."""
    flat = info.fragment.detach().view(-1)
    start = info.start
    whole = tuple(info.shape)
    pos = 0
    for offsets, sizes, _ in rectangles(start, start + flat.numel(), tuple(info.local_shape)):
        corner = [o + base for o, base in zip(offsets, info.origin, strict=True)]
        inner = len(sizes) - 1  # iterate the dims before the contiguous tail
        while inner > 0 and tuple(sizes[inner:]) == whole[inner:]:
            inner -= 1
        run = math.prod(sizes[inner:])
        for lead in itertools.product(*(range(n) for n in sizes[:inner])):
            index = [c + i for c, i in zip(corner, lead, strict=False)] + corner[len(lead) :]
            opened.read(file, stored, _ravel(index, whole), flat[pos : pos + run])
            pos += run


def _ravel(index: list[int], shape: tuple[int, ...]) -> int:
    """The row-major flat position of ``index`` in a tensor of ``shape``."""
    flat = 0
    for i, n in zip(index, shape, strict=True):
        flat = flat * n + i
    return flat


def _check(layout: ModelLayout, files: dict[str, Path], sources: dict[str, str], opened) -> None:
    for name, stored in sources.items():
        want = layout.params[name].shape if name in layout.params else layout.buffers[name].shape
        have = tuple(opened.entry(files[stored], stored)[1])
        if have != tuple(want):
            raise ValueError(f"{stored!r} has shape {list(have)} in the file, {list(want)} here")


@torch.no_grad()
def load_sliced(path: Path, model: nn.Module) -> dict:
    """Fill ``model``'s fragments (and buffers) from safetensors files, each rank its own."""
    layout = model_layout(model)
    with _Files() as opened:
        error = None
        try:
            files = _weight_files(path)
            sources, missing = _sources(layout, files, _tied_sources(model))
            if missing:
                raise ValueError(f"lacks {missing[:5]}; pass the weights of this architecture")
            _check(layout, files, sources, opened)
        except (OSError, ValueError, KeyError) as err:
            error = f"cannot load {path}: {err}"
        agree.raise_if(agree.first_error(error, agree.model_group(model)))
        for name, p in layout.params.items():
            if p.fragment.numel() and p.origin is not None:  # a TP block or an expert
                _read_placed(opened, files[sources[name]], sources[name], p)
            elif p.fragment.numel():
                start = fragment_tag(p.fragment).flat_range[0]
                opened.read(files[sources[name]], sources[name], start, p.fragment.detach())
        for name, buf in layout.buffers.items():
            if name in sources:
                opened.read(files[name], name, 0, buf)
    if dist.is_initialized():
        dist.barrier(agree.model_group(model))  # nobody trains on half-loaded weights
    return {}
