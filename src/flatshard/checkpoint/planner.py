"""DCP planners that describe flat fragments as rectangular chunks of full-shape tensors.

[Note: how a fragment is described]
A fragment is this rank's contiguous piece ``[start, end)`` of a *flattened* parameter of shape
``shape``. A contiguous range of a row-major tensor is a few rectangles: a partial first row,
full rows, a partial last row (and recursively inside a partial row for 3-D and up: at most
``2 * ndim - 1``). We hand DCP exactly those, as chunks of the global tensor with its real
shape, so the checkpoint is a standard DCP checkpoint: ``dcp_to_torch_save`` gives the plain
state dict, and torch FSDP2 (``dcp.load`` + ``set_model_state_dict``) reads it at any world
size. DCP merges the chunks of all ranks into one entry per key, deduplicates identical
``(key, offset)`` chunks (replicas: no_shard, hybrid_shard) and at load time computes, for any
other layout, which saved chunks overlap each new rectangle. A rank whose fragment is empty
writes (and reads) nothing for that key. Checkpoints written before this layout (manifest
version 1) stored each parameter as a 1-D tensor of its numel; a target whose saved size is
``[numel]`` is read that way.

Plain tensors (buffers, ``step``) are replicated: every rank offers the same key and DCP keeps
one copy. The optimizer's param groups are also written the way DCP writes non-tensors (``BYTE_IO``:
``torch.save`` bytes), because torch's ``set_optimizer_state_dict`` needs them; DCP's loader
reads those with ``torch.load(weights_only=False)``, so flatshard never requests one: its load
planner refuses them outright and takes the values from its JSON description instead.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


@dataclass
class Sharded:
    """This rank's piece ``[start, start + local.numel())`` of a flattened global tensor of
    shape ``shape`` (``None``: described as a 1-D tensor of ``numel``, the version-1 layout)."""

    local: torch.Tensor  # 1-D; for a fragment, the fragment itself (or a snapshot of it)
    start: int
    numel: int
    shape: torch.Size | None = None
    # A tensor-parallel parameter: ``start``/``numel``/``shape`` describe its TP-local block,
    # which sits at ``origin`` of the global tensor of shape ``whole_shape`` (see
    # [Note: tensor-parallel parameters] in parallel/tensor.py).
    whole_shape: torch.Size | None = None
    origin: tuple[int, ...] | None = None

    def chunks(self, flat: bool = False) -> list[tuple[ChunkStorageMetadata, torch.Tensor]]:
        """(chunk of the global tensor, the view of ``local`` that holds it) per rectangle;
        ``flat``: one chunk of the 1-D global tensor (the version-1 layout)."""
        end = self.start + self.local.numel()
        if flat or self.shape is None:
            return [(_meta((self.start,), (self.local.numel(),)), self.local)]
        origin = self.origin or (0,) * len(self.shape)
        out = []
        for offsets, sizes, begin in rectangles(self.start, end, tuple(self.shape)):
            n = math.prod(sizes)
            view = self.local[begin - self.start : begin - self.start + n].view(sizes)
            shifted = tuple(o + base for o, base in zip(offsets, origin, strict=True))
            out.append((_meta(shifted, sizes), view))
        return out

    @property
    def global_size(self) -> torch.Size:
        if self.whole_shape is not None:
            return torch.Size(self.whole_shape)
        return torch.Size([self.numel]) if self.shape is None else torch.Size(self.shape)


@dataclass(frozen=True)
class Pickled:
    """A plain Python value written as DCP writes non-tensors (``torch.save`` bytes), for
    torch's tools (``set_optimizer_state_dict`` needs the param groups). flatshard itself
    never reads one back: its own copy of these values is the JSON description."""

    value: object


Item = Sharded | torch.Tensor | Pickled


def _meta(offsets, sizes) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))


def rectangles(start: int, end: int, shape: tuple[int, ...]) -> list[tuple[tuple, tuple, int]]:
    """Elements ``[start, end)`` of a row-major tensor of ``shape`` as rectangles:
    ``(offsets, sizes, flat index of the first element)``, in order."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,) * len(shape), (end - start,) * len(shape), start)]
    row = math.prod(shape[1:])
    out: list[tuple[tuple, tuple, int]] = []
    first = start // row
    if start % row or end < (first + 1) * row:  # a partial first row
        stop = min(end, (first + 1) * row)
        for off, size, flat in rectangles(start - first * row, stop - first * row, shape[1:]):
            out.append(((first, *off), (1, *size), flat + first * row))
        start, first = stop, first + 1
    full_rows_end = end // row
    if start < end and full_rows_end > first:
        zeros = (0,) * (len(shape) - 1)
        out.append(((first, *zeros), (full_rows_end - first, *shape[1:]), first * row))
        start = full_rows_end * row
    if start < end:  # a partial last row
        last = start // row
        for off, size, flat in rectangles(0, end - last * row, shape[1:]):
            out.append(((last, *off), (1, *size), flat + last * row))
    return out


def _plain_chunk(obj: torch.Tensor) -> ChunkStorageMetadata:
    return _meta((0,) * obj.dim(), obj.size())


def _write_items(fqn: str, obj: Item) -> list[tuple[WriteItem, object]]:
    if isinstance(obj, Pickled):
        return [(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO), obj)]
    if isinstance(obj, Sharded):
        kind, size, pieces = WriteItemType.SHARD, obj.global_size, obj.chunks()
    else:
        kind, size, pieces = WriteItemType.TENSOR, obj.size(), [(_plain_chunk(obj), obj)]
    items = []
    for chunk, data in pieces:
        item = WriteItem(
            index=MetadataIndex(fqn, chunk.offsets),
            type=kind,
            tensor_data=TensorWriteData(
                chunk=chunk, properties=TensorProperties.create_from_tensor(data), size=size
            ),
        )
        items.append((item, data))
    return items


def _is_empty(obj: Item) -> bool:
    return isinstance(obj, Sharded) and obj.local.numel() == 0


class FlatSavePlanner(DefaultSavePlanner):
    """Writes this rank's chunk of every ``Sharded`` item and every plain tensor."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        self._data: dict[tuple, torch.Tensor] = {}
        items = []
        for fqn, obj in self.state_dict.items():
            if _is_empty(obj):
                continue
            for item, data in _write_items(fqn, obj):
                self._data[(fqn, tuple(item.index.offset or ()))] = data
                items.append(item)
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        # DCP clones a view whose storage is larger than itself before torch.save, so a
        # rectangle of a fragment (a view of the shard) is written as just its own elements.
        key = (write_item.index.fqn, tuple(write_item.index.offset or ()))
        data = self._data[key]
        if isinstance(data, Pickled):  # as DCP's own planner writes a non-tensor
            buffer = io.BytesIO()
            torch.save(data.value, buffer)
            buffer.seek(0)
            return buffer
        return data.detach()


class FlatLoadPlanner(DefaultLoadPlanner):
    """Reads, for each target, the saved chunks that overlap this rank's piece of it."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(
        self, state_dict: dict, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        # No _init_state_dict / flattening: our targets are already flat and allocated.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        requests: list[ReadItem] = []
        self._views: dict[str, list[torch.Tensor]] = {}
        for fqn, obj in self.state_dict.items():
            if _is_empty(obj):
                continue
            md = self.metadata.state_dict_metadata[fqn]  # presence checked by the caller
            if isinstance(obj, Sharded):
                # version 1 stored a 1-D tensor of numel: read it as that
                legacy = obj.shape is not None and len(obj.shape) != 1 and len(md.size) == 1
                pieces = obj.chunks(flat=legacy)
            else:
                pieces = [(_plain_chunk(obj), obj)]
            self._views[fqn] = [view for _, view in pieces]
            requests += create_read_items_for_chunk_list(fqn, md, [c for c, _ in pieces])
        return LoadPlan(requests)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        view = self._views[read_item.dest_index.fqn][read_item.dest_index.index or 0]
        return narrow_tensor_by_index(view, read_item.dest_offsets, read_item.lengths)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise ValueError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; flatshard "
            "checkpoints hold only tensors and refuse to unpickle anything else"
        )


class VerifiedReader(FileSystemReader):
    """A ``FileSystemReader`` that serves metadata we already read and validated ourselves,
    instead of unpickling ``.metadata`` with plain ``pickle`` as DCP would."""

    def __init__(self, path: str, metadata: Metadata) -> None:
        super().__init__(path)
        self._validated = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:
            raise ValueError("flatshard checkpoints have one global .metadata, not per-rank ones")
        if self._validated.storage_meta is None:
            self._validated.storage_meta = StorageMeta()
        self._validated.storage_meta.load_id = self.load_id
        return self._validated
