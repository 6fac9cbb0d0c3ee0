"""Full export to one safetensors file, from a live sharded model or from a checkpoint.

Both stream: the header is written first, then parameters in batches. From a model, a batch is
a unit: every rank gathers it, rank 0 writes its parameters, the unit reshards (peak: one
gathered unit, as in training). From a checkpoint (one process, no process group), a batch is
a group of consecutive entries up to ``batch_bytes`` (or one parameter if larger), read through
DCP from whichever shards hold it. Optimizer state is never read. Tied parameters are written
under every name (a plain ``load_state_dict`` wants them all), the data read once per name.

With tensor parallelism the file holds global tensors, as ``fs.full_state_dict`` does: the
first dp rank of every tp column gathers each TP parameter over its tp peers
(``full_tensor``), the model's first rank (``writes_files``) writes it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from flatshard.checkpoint import agree
from flatshard.checkpoint.contents import ModelLayout, dtype_from_name, model_layout
from flatshard.checkpoint.planner import Item
from flatshard.checkpoint.reading import Opened, open_checkpoint, read_tensors, verify_files
from flatshard.checkpoint.safetensors_io import StreamingSafetensorsWriter
from flatshard.core.masters import master_views
from flatshard.core.params import fragment_tag
from flatshard.core.state import ShardedState, get_state
from flatshard.parallel.placed_state import gather_placed, has_own_mesh
from flatshard.parallel.tensor import full_tensor

DEFAULT_BATCH_BYTES = 256 << 20
EXPORT_METADATA = {"format": "pt", "producer": "flatshard"}


def export_safetensors(
    source: nn.Module | str | os.PathLike, out_path: str | os.PathLike
) -> Path | None:
    """Write every parameter and buffer, full shapes, original names, into ``out_path``.

    ``source`` is a sharded model (every rank must call; rank 0 writes and gets the path,
    other ranks ``None``) or a checkpoint directory (one process, no process group needed).
    The file loads into the plain, unsharded model with ``load_state_dict``.
    """
    if isinstance(source, nn.Module):
        return _export_model(source, Path(out_path))
    return export_checkpoint(source, out_path)


def unit_keys_of(model: nn.Module, layout: ModelLayout) -> dict[int, list[str]]:
    """Unit index -> its state_dict keys (tied names with their source), in key order."""
    keys: dict[int, list[str]] = {}
    for key in layout.keys:
        source = layout.aliases.get(key, key)
        if source in layout.params:
            tag = fragment_tag(layout.params[source].fragment)
            keys.setdefault(tag.unit, []).append(key)
    return keys


def writes_files(state: ShardedState) -> bool:
    """The model's first rank (with TP: the first dp rank of the first tp column)."""
    return state.topology.is_mesh_first and (state.tp is None or state.tp.is_tp_first)


def full_views(unit, group_views) -> dict[int, tuple[torch.Tensor, object]]:
    """id(fragment) -> (its gathered view, its TPSpec or None) of every parameter of ``unit``
    (``group_views``: the unit's views by flat group)."""
    views = {}
    for group, gathered in zip(unit.groups, group_views, strict=True):
        for spec, tp, view in zip(group.specs, group.tp, gathered, strict=True):
            views[id(spec.fragment)] = (view, tp)
    return views


def _export_model(model: nn.Module, out: Path) -> Path | None:
    state = get_state(model)
    layout = model_layout(model)  # experts without a placement raise here, on every rank
    unit_keys = unit_keys_of(model, layout)
    order = [k for unit in state.units for k in unit_keys.get(unit.index, [])]
    order += list(layout.buffers)
    writer, error = None, None
    if writes_files(state):  # the model's first rank writes, as full_state_dict
        try:
            writer = StreamingSafetensorsWriter(
                out, [header_entry(layout, k) for k in order], EXPORT_METADATA
            )
        except (OSError, ValueError) as err:
            error = f"cannot write {out}: {err}"
    for unit in state.units:  # every rank gathers, even after a write error on rank 0
        with master_views(state, unit) as views:  # fp32 masters under mixed precision
            if has_own_mesh(unit):  # experts: the global stacks, on the model's first rank
                keys = unit_keys.get(unit.index, [])
                error = _write_placed(model, state, unit, views, keys, layout, writer, error)
            elif state.topology.is_mesh_first:  # with TP, these gather over tp together
                keys = unit_keys.get(unit.index, [])
                error = write_unit(writer, error, full_views(unit, views), keys, layout)
    if writer is not None:
        error = error or _finish(writer, layout)
    if error is not None and writer is not None:
        writer.abort()
    agree.raise_if(agree.from_rank0(error, agree.model_group(model)), OSError)
    return out if writer is not None else None


def write_unit(writer, error, views: dict, keys: list[str], layout: ModelLayout) -> str | None:
    """A dp mesh's first rank: each of ``keys`` as its global tensor (gathered over tp,
    whether this rank writes or not), written by the writer while no error occurred."""
    for key in keys:
        view, tp = views[id(layout.params[layout.aliases.get(key, key)].fragment)]
        whole = full_tensor(view, tp)
        if writer is None or error is not None:
            continue
        try:
            writer.write(key, whole)
        except OSError as err:
            error = f"writing {writer.out}: {err}"
    return error


def _write_placed(model, state, unit, views, keys, layout, writer, error) -> str | None:
    """A unit on its own mesh (experts): every rank sends its blocks, the model's first rank
    writes each of ``keys`` as the global tensor (see parallel/placed_state.py)."""
    sources = {key: layout.aliases.get(key, key) for key in keys}
    where = []
    for source in dict.fromkeys(sources.values()):
        tag = fragment_tag(layout.params[source].fragment)
        where.append((source, tag.group, tag.index))
    wholes = gather_placed(model, state, unit, views, where)
    for key, source in sources.items():
        if writer is None or error is not None:
            break
        try:
            writer.write(key, wholes[source])
        except OSError as err:
            error = f"writing {writer.out}: {err}"
    return error


def _finish(writer: StreamingSafetensorsWriter, layout: ModelLayout) -> str | None:
    """Rank 0: write the buffers and close the file; a failure is returned, not raised (the
    other ranks wait to hear about it)."""
    try:
        for name, buf in layout.buffers.items():
            writer.write(name, buf)
        writer.close()
    except OSError as err:
        writer.abort()
        return f"writing {writer.out}: {err}"
    return None


def header_entry(layout: ModelLayout, key: str) -> tuple[str, torch.dtype, tuple[int, ...]]:
    source = layout.aliases.get(key, key)
    if source in layout.params:
        p = layout.params[source]
        return key, p.fragment.dtype, tuple(p.shape)
    buf = layout.buffers[source]
    return key, buf.dtype, tuple(buf.shape)


def export_checkpoint(
    ckpt: str | os.PathLike, out_path: str | os.PathLike, *, batch_bytes: int = DEFAULT_BATCH_BYTES
) -> Path:
    """Checkpoint directory -> one safetensors file, in this process (no process group)."""
    opened = open_checkpoint(ckpt)
    if problem := verify_files(opened, opened.data_files):
        raise ValueError(problem)
    model = opened.description["model"]
    entries = [saved_entry(opened, model, key) for key in model["keys"]]
    writer = StreamingSafetensorsWriter(out_path, entries, EXPORT_METADATA)
    try:
        for batch in in_batches(entries, batch_bytes):
            loaded = read_full(opened, model, {model["aliases"].get(k, k) for k, _, _ in batch})
            for key, _, shape in batch:
                writer.write(key, loaded[model["aliases"].get(key, key)].view(shape))
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def saved_entry(opened: Opened, model: dict, key: str) -> tuple[str, torch.dtype, tuple]:
    source = model["aliases"].get(key, key)
    entry = model["params"].get(source) or model["buffers"][source]
    md = opened.metadata.state_dict_metadata.get(source)
    dtype = md.properties.dtype if md is not None else dtype_from_name(entry["dtype"])
    return key, dtype, tuple(entry["shape"])


def in_batches(entries: list, limit: int) -> list[list]:
    batches, current, size = [], [], 0
    for entry in entries:
        nbytes = entry[1].itemsize * max(1, int(torch.Size(entry[2]).numel()))
        if current and size + nbytes > limit:
            batches.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes
    return batches + ([current] if current else [])


def read_full(opened: Opened, model: dict, names: set[str]) -> dict[str, torch.Tensor]:
    """Full tensors (flat for parameters) of ``names``, read from every shard that holds them."""
    targets: dict[str, Item] = {}
    out: dict[str, torch.Tensor] = {}
    for name in sorted(names):
        md = opened.metadata.state_dict_metadata.get(name)
        if md is None:  # a zero-element parameter has no chunks
            dtype = dtype_from_name(model["params"][name]["dtype"])
            out[name] = torch.empty(0, dtype=dtype)
            continue
        full = torch.empty(md.size, dtype=md.properties.dtype)  # 1-D for version-1 params
        targets[name] = full
        out[name] = full
    read_tensors(opened, targets, None)
    return out
