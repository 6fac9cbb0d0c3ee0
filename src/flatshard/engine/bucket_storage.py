"""The memory under a bucket's gathered members: one storage per compute dtype, reused.

See [Note: coalesced units] in ``buckets.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .gather_pool import GatheredBytes
from .layout import align_elements, aligned_offsets

if TYPE_CHECKING:
    from .flat_group import FlatGroup


class StorageCache:
    """Released bucket storages whose memory is kept for their next gather.

    Freeing a storage hands its pages back to the OS when the allocator maps large buffers
    (glibc above ``MALLOC_MMAP_THRESHOLD_``): the next gather of the bucket maps fresh pages,
    which the kernel zeroes on first touch. The buckets of a step are released and gathered
    again in a cycle (forward, then backward in reverse, then the next forward), so keeping
    the first ``keep`` released storages lets the next gathers reuse their memory; a release
    beyond that frees its storage. Only storages of at most ``max_bytes``
    (``Coalesce.bucket_bytes``) are kept, so the cache holds at most ``keep * max_bytes``,
    through the loss and between steps too (emptying it when the forward ends, as the gather
    pool is, left most of the gain: measured in docs/performance.md, session 8)."""

    def __init__(self, keep: int, max_bytes: int) -> None:
        self.keep = keep
        self.max_bytes = max_bytes
        self._cached: list[SharedStorage] = []

    def offer(self, storage: SharedStorage) -> bool:
        """Keep ``storage``'s memory (True) or let the caller free it (False)."""
        if len(self._cached) >= self.keep or storage.payload_bytes > self.max_bytes:
            return False
        self._cached.append(storage)
        return True

    def take(self, storage: SharedStorage) -> bool:
        """``storage`` is gathered again: was its memory still kept?"""
        if storage in self._cached:
            self._cached.remove(storage)
            return True
        return False


class SharedStorage:
    """One storage under the full buffers of a bucket's members of one compute dtype: each
    member's private buffer is a view of it, so a regather makes saved views valid again as
    for any private buffer ([Note: full buffer lifetime]), but a bucket gather allocates once,
    not once per member. Allocated while any member holds its part, and after the last lets
    go while ``cache`` keeps it (see ``StorageCache``)."""

    def __init__(
        self, groups: list[FlatGroup], account: GatheredBytes, cache: StorageCache | None
    ) -> None:
        dtype = groups[0].compute_dtype
        starts = aligned_offsets([g.padded_numel for g in groups], align_elements(dtype))
        self.buffer = torch.empty(starts[-1], dtype=dtype, device=groups[0].device)
        self.nbytes = self.buffer.untyped_storage().nbytes()
        self.payload_bytes = sum(g.padded_numel for g in groups) * dtype.itemsize  # no alignment
        self.account = account
        self.cache = cache
        self._holders: set[int] = set()
        self.allocations = 0  # fresh memory so far (tests: one a step with three buckets)
        for g, offset in zip(groups, starts, strict=False):  # each on a 16-byte boundary too
            g.share_storage(self, self.buffer[offset : offset + g.padded_numel])
        self.buffer.untyped_storage().resize_(0)  # the views keep pointing at it

    @property
    def allocated(self) -> bool:
        """Does the storage hold memory now (held by a member, or kept by the cache)?"""
        return self.buffer.untyped_storage().nbytes() > 0

    def holds(self, group: FlatGroup) -> bool:
        return id(group) in self._holders

    def hold(self, group: FlatGroup) -> None:
        if not self._holders:
            kept = self.cache is not None and self.cache.take(self)
            if not kept and not self.allocated:
                self.allocations += 1
                self.buffer.untyped_storage().resize_(self.nbytes)
                self.account.change(self.nbytes)
        self._holders.add(id(group))

    def release(self, group: FlatGroup) -> None:
        self._holders.discard(id(group))
        if self._holders or not self.allocated:
            return
        if self.cache is None or not self.cache.offer(self):
            self.free()

    def free(self) -> None:
        if not self._holders and self.allocated:
            self.buffer.untyped_storage().resize_(0)
            self.account.change(-self.nbytes)
