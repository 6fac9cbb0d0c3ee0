"""Reused gather buffers: a unit's all-gather lands in a buffer handed back by an earlier unit.

Without a pool every gather allocates its full buffer and every reshard frees it. Large
allocations come straight from the OS (fresh pages, zeroed on first touch; measured 1.4 ms per
6.8 MiB on the CI box with ``MALLOC_MMAP_THRESHOLD_=65536``), so a 6-block model paid that 12
times per step. With the pool, consecutive units ping-pong between a few buffers (two with the
default prefetch). The free ones are dropped when a forward ends (activations peak there and
nothing needs them until backward), so a step allocates one buffer instead of one per gather.

[Note: gather buffers and saved tensors]
Autograd saves views of the gathered parameters (``linear`` saves its weight) and reads them in
backward, after the unit was resharded and regathered. A private buffer per unit keeps one
storage across the gap, so the saved views become valid again on regather. A pooled buffer
instead belongs to another unit by then, and the regather lands in whichever buffer is free;
so while a pooled unit runs its forward, saved-tensor hooks (``saved_views.py``) replace every
saved view of its buffer by (unit, offset, shape, strides) and rebuild it from the unit's
*current* buffer when backward unpacks it. When those hooks cannot be installed (the user has
saved-tensor hooks of their own around the forward) the unit moves to its private buffer first.

[Note: the pool only where it pays]
The pool works around the host allocator (glibc's fresh pages for large blocks), so it is
made only for host gathers over Gloo (``pays_off``). On a device the caching allocator
already reuses freed blocks, and any other process group (NCCL, or the ``strict_async`` test
backend that holds CPU runs to NCCL's rules) takes the plain path: private buffers, their
full-shape views built once per buffer instead of once per borrowed one, and no saved-tensor
hook on every tensor a unit's forward saves (``bench/bench_host_overhead.py`` measures what
that is per unit).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from flatshard.core.mesh import Topology

Kind = tuple[torch.dtype, torch.device]


def pays_off(topology: Topology) -> bool:
    """Make a pool for this topology? Host gathers over Gloo only (see [Note: the pool only
    where it pays]); a shard group of one rank gathers nothing over any backend."""
    group = topology.shard_group
    return topology.device.type == "cpu" and (group is None or dist.get_backend(group) == "gloo")


class GatheredBytes:
    """flatshard's own count of the bytes held for gathered parameters (private buffers while
    allocated, pooled buffers while they exist, in use or free) and its peak; benchmarks report
    it next to the process's peak RSS."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0

    def change(self, delta: int) -> None:
        self.current += delta
        self.peak = max(self.peak, self.current)


class GatherPool:
    """Free buffers by (dtype, device), handed out best-fit; at most ``keep`` kept per kind."""

    def __init__(self, keep: int, account: GatheredBytes) -> None:
        self.keep = keep
        self.account = account
        self._free: dict[Kind, list[torch.Tensor]] = {}
        # address -> (owner, buffer); the owner is opaque here (saved_views asks for it back)
        self.live: dict[int, tuple[object, torch.Tensor]] = {}
        self.allocations = 0  # buffers created so far (tests: constant after the first step)

    def acquire(
        self, numel: int, dtype: torch.dtype, device: torch.device, owner: object
    ) -> torch.Tensor:
        """A 1-D buffer of at least ``numel`` elements for ``owner``'s gather; a free one no
        more than twice that size if there is one, else a new exact-size one."""
        free = self._free.get((dtype, device), [])
        fits = [i for i, buf in enumerate(free) if numel <= buf.numel() <= 2 * numel]
        if fits:
            buf = free.pop(min(fits, key=lambda i: free[i].numel()))
        else:
            self.allocations += 1
            buf = torch.empty(numel, dtype=dtype, device=device)
            self.account.change(_nbytes(buf))
        self.live[buf.untyped_storage().data_ptr()] = (owner, buf)
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Hand ``buf`` back; beyond ``keep`` free buffers of its kind the smallest is dropped
        (after a summon of the whole model the pool shrinks back to what training uses)."""
        self.live.pop(buf.untyped_storage().data_ptr(), None)
        free = self._free.setdefault((buf.dtype, buf.device), [])
        free.append(buf)
        if len(free) > self.keep:
            smallest = min(range(len(free)), key=lambda i: free[i].numel())
            self.account.change(-_nbytes(free.pop(smallest)))

    def trim(self) -> None:
        """Drop the free buffers. Called when a forward ends: until the backward's first
        regather nothing needs them, and this is when activations peak."""
        for buf in self.free_buffers():
            self.account.change(-_nbytes(buf))
        self._free.clear()

    def owner(self, tensor: torch.Tensor) -> object | None:
        """The owner (a ``FlatGroup``) of the pooled buffer ``tensor`` views, if any."""
        user = self.live.get(tensor.untyped_storage().data_ptr())
        return None if user is None else user[0]

    def free_buffers(self) -> list[torch.Tensor]:
        return [buf for bufs in self._free.values() for buf in bufs]

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer the pool holds, in use or free (memory accounting)."""
        in_use = [buf for _, buf in self.live.values()]
        return in_use + self.free_buffers()


def _nbytes(buf: torch.Tensor) -> int:
    return buf.untyped_storage().nbytes()
