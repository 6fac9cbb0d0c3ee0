"""``fs.save_pretrained``: a sharded transformers model -> a directory ``from_pretrained`` loads.

Written the way ``PreTrainedModel.save_pretrained`` writes it: ``config.json`` (and
``generation_config.json`` when the model has one), the weights as ``model.safetensors`` or,
beyond ``max_shard_size``, ``model-0000k-of-0000N.safetensors`` plus
``model.safetensors.index.json``; tied weights once (under their first name: transformers ties
the others again on load), ``__metadata__ = {"format": "pt"}``. The weights stream unit by unit:
every rank gathers one unit at a time and global rank 0 appends its tensors to the open file,
so no process holds more than one gathered unit and the file's write buffer. With tensor
parallelism the weights are global tensors, gathered over tp as ``fs.export_safetensors``
does, and the model's first rank writes them.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from torch import nn

from flatshard.checkpoint import agree
from flatshard.checkpoint.contents import model_layout
from flatshard.checkpoint.exporting import (
    full_views,
    header_entry,
    unit_keys_of,
    write_unit,
    writes_files,
)
from flatshard.checkpoint.safetensors_io import StreamingSafetensorsWriter
from flatshard.core.masters import master_views
from flatshard.core.state import get_state
from flatshard.parallel.unit_mesh import refuse_unit_meshes

SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
SIZE_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
INDEX = "model.safetensors.index.json"


def parse_size(size: int | str) -> int:
    """``5_000_000``, ``"5GB"`` (10^9, as transformers reads it) or ``"5GiB"`` -> bytes."""
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
        if match is None or match.group(2) not in SIZE_UNITS:
            raise ValueError(f"max_shard_size={size!r}: write e.g. '5GB', '500MB' or a byte count")
        value = int(float(match.group(1)) * SIZE_UNITS[match.group(2)])
    if value <= 0:
        raise ValueError(f"max_shard_size={size!r} must be positive")
    return value


def _files(entries: list[tuple], limit: int) -> list[list[tuple]]:
    """Consecutive entries per file, each file at most ``limit`` bytes (a larger tensor alone)."""
    files: list[list[tuple]] = [[]]
    used = 0
    for entry in entries:
        nbytes = entry[1].itemsize * math.prod(entry[2])
        if files[-1] and used + nbytes > limit:
            files.append([])
            used = 0
        files[-1].append(entry)
        used += nbytes
    return files


def _names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


class _ShardedWriter:
    """Rank 0's sequence of safetensors files, opened one at a time, filled in order."""

    def __init__(self, out: Path, files: list[list[tuple]]) -> None:
        self.out, self.files, self.names = out, files, _names(len(files))
        self.index, self.written, self.current = 0, 0, None

    def write(self, name: str, tensor) -> None:
        if self.current is None:
            entries = self.files[self.index]
            path = self.out / self.names[self.index]
            self.current = StreamingSafetensorsWriter(path, entries, {"format": "pt"})
        self.current.write(name, tensor)
        self.written += 1
        if self.written == len(self.files[self.index]):
            self.current.close()
            self.current, self.index, self.written = None, self.index + 1, 0

    def abort(self) -> None:
        if self.current is not None:
            self.current.abort()

    def weight_map(self) -> dict[str, str]:
        pairs = zip(self.files, self.names, strict=True)
        return {entry[0]: name for entries, name in pairs for entry in entries}


def save_pretrained(
    model: nn.Module, path: str | os.PathLike, *, max_shard_size: int | str = "5GB"
) -> Path | None:
    """Write ``model`` (a sharded transformers model) so that ``from_pretrained(path)`` loads
    it. Every rank must call it; the model's first rank writes and gets the path, others
    ``None``."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise TypeError(
            f"fs.save_pretrained needs a transformers model (with .config); "
            f"{type(model).__name__} has none: use fs.export_safetensors(model, 'x.safetensors')"
        )
    limit = parse_size(max_shard_size)
    state = get_state(model)
    refuse_unit_meshes(state, "fs.save_pretrained")
    layout = model_layout(model)
    tied = layout.aliases  # written once, under the first name
    keys = {u: [k for k in ks if k not in tied] for u, ks in unit_keys_of(model, layout).items()}
    order = [k for unit in state.units for k in keys.get(unit.index, [])] + list(layout.buffers)
    out, writer, error = Path(path), None, None
    if writes_files(state):  # the model's first rank writes
        try:
            out.mkdir(parents=True, exist_ok=True)
            writer = _ShardedWriter(out, _files([header_entry(layout, k) for k in order], limit))
            _write_configs(model, out)
        except (OSError, ValueError) as err:
            error = f"cannot write {out}: {err}"
    error = _stream_units(state, layout, keys, writer, error)
    if writer is not None and error is None:
        error = _finish(writer, layout.buffers, out)
    if error is not None and writer is not None:
        writer.abort()
    agree.raise_if(agree.from_rank0(error, agree.model_group(model)), OSError)
    return out if writer is not None else None


def _write_configs(model: nn.Module, out: Path) -> None:
    model.config.save_pretrained(out)
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(out)


def _stream_units(state, layout, unit_keys, writer, error) -> str | None:
    """Every rank gathers each unit in turn (even after rank 0 failed); rank 0 writes it.
    With TP the first dp rank of every tp column gathers each TP parameter over tp."""
    for unit in state.units:
        with master_views(state, unit) as group_views:  # fp32 masters under mixed precision
            if state.topology.is_mesh_first:
                views = full_views(unit, group_views)
                error = write_unit(writer, error, views, unit_keys.get(unit.index, []), layout)
    return error


def _finish(writer: _ShardedWriter, buffers: dict, out: Path) -> str | None:
    try:
        for name, buf in buffers.items():
            writer.write(name, buf)
        if len(writer.files) > 1:
            total = sum(
                e[1].itemsize * math.prod(e[2]) for entries in writer.files for e in entries
            )
            index = {"metadata": {"total_size": total}, "weight_map": writer.weight_map()}
            (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    except OSError as err:
        return f"writing {out}: {err}"
    return None


def export_pretrained(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    config: str | os.PathLike,
    max_shard_size: int | str = "5GB",
    batch_bytes: int = 256 << 20,
) -> Path:
    """A flatshard checkpoint directory -> a ``from_pretrained`` directory, in this process.
    ``config``: the model's ``config.json`` or a directory holding it (and possibly
    ``generation_config.json``), e.g. the model's original ``save_pretrained`` directory."""
    from flatshard.checkpoint.exporting import in_batches, read_full, saved_entry
    from flatshard.checkpoint.reading import open_checkpoint, verify_files

    opened = open_checkpoint(ckpt)
    if problem := verify_files(opened, opened.data_files):
        raise ValueError(problem)
    model = opened.description["model"]
    keys = [k for k in model["keys"] if k not in model["aliases"]]  # tied weights once
    entries = [saved_entry(opened, model, key) for key in keys]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _copy_configs(Path(config), out)
    writer = _ShardedWriter(out, _files(entries, parse_size(max_shard_size)))
    try:
        for batch in in_batches(entries, batch_bytes):
            loaded = read_full(opened, model, {k for k, _, _ in batch})
            for key, _, shape in batch:
                writer.write(key, loaded[key].view(shape))
    except BaseException:
        writer.abort()
        raise
    if problem := _finish(writer, {}, out):  # the buffers came with the rest, in key order
        raise OSError(problem)
    return out


def _copy_configs(config: Path, out: Path) -> None:
    sources = [config] if config.is_file() else [config / "config.json"]
    if config.is_dir() and (config / "generation_config.json").is_file():
        sources.append(config / "generation_config.json")
    if not sources[0].is_file():
        raise ValueError(f"--config {config}: no config.json there (pass the model's directory)")
    for source in sources:
        (out / source.name).write_bytes(source.read_bytes())
