"""DCP planners that describe flat fragments as chunks of 1-D global tensors.

[Note: how a fragment is described]
A fragment is this rank's contiguous piece ``[start, end)`` of a *flattened* parameter of
``numel`` elements. We hand DCP exactly that: a global 1-D tensor of size ``numel`` of which this
rank writes the chunk at offset ``start``. DCP merges the chunks of all ranks into one entry per
key, deduplicates identical ``(key, offset)`` chunks (replicas under a future hybrid strategy) and
at load time computes, for any other layout, which saved chunks overlap each new fragment. A rank
whose fragment is empty writes (and reads) nothing for that key.

Plain tensors (buffers, ``step``) are replicated: every rank offers the same key and DCP keeps
one copy. We never let DCP write ``BYTE_IO`` items, because its loader reads them with
``torch.load(weights_only=False)``: our load planner refuses them outright.
"""

from __future__ import annotations

import io
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
    """This rank's piece ``[start, start + local.numel())`` of a flat global tensor."""

    local: torch.Tensor  # 1-D; for a fragment, the fragment itself (or a snapshot of it)
    start: int
    numel: int


Item = Sharded | torch.Tensor


def _chunk(obj: Item) -> ChunkStorageMetadata:
    if isinstance(obj, Sharded):
        return ChunkStorageMetadata(torch.Size([obj.start]), torch.Size([obj.local.numel()]))
    return ChunkStorageMetadata(torch.Size([0] * obj.dim()), obj.size())


def _write_item(fqn: str, obj: Item) -> WriteItem:
    local = obj.local if isinstance(obj, Sharded) else obj
    chunk = _chunk(obj)
    size = torch.Size([obj.numel]) if isinstance(obj, Sharded) else obj.size()
    return WriteItem(
        index=MetadataIndex(fqn, chunk.offsets),
        type=WriteItemType.SHARD if isinstance(obj, Sharded) else WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=chunk, properties=TensorProperties.create_from_tensor(local), size=size
        ),
    )


def _is_empty(obj: Item) -> bool:
    return isinstance(obj, Sharded) and obj.local.numel() == 0


class FlatSavePlanner(DefaultSavePlanner):
    """Writes this rank's chunk of every ``Sharded`` item and every plain tensor."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items = [_write_item(k, v) for k, v in self.state_dict.items() if not _is_empty(v)]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        obj = self.state_dict[write_item.index.fqn]
        # DCP clones a view whose storage is larger than itself before torch.save, so a
        # fragment (a view of the shard) is written as just its own elements.
        return (obj.local if isinstance(obj, Sharded) else obj).detach()


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
        for fqn, obj in self.state_dict.items():
            if _is_empty(obj):
                continue
            md = self.metadata.state_dict_metadata[fqn]  # presence checked by the caller
            requests += create_read_items_for_chunk_list(fqn, md, [_chunk(obj)])
        return LoadPlan(requests)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        obj = self.state_dict[read_item.dest_index.fqn]
        local = obj.local if isinstance(obj, Sharded) else obj
        return narrow_tensor_by_index(local, read_item.dest_offsets, read_item.lengths)

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
