"""``fs.CPUOffload``: keep the sharded state in CPU memory, compute on the accelerator.

With ``CPUOffload(params=True)`` every flat group's shard (and therefore the optimizer's
fragments, their gradients and the optimizer state, which is created next to them) lives in
host memory, pinned when CUDA is used so host-to-device copies run asynchronously. Before each
all-gather the shard is copied to the device (cast to ``param_dtype`` on the way); after each
reduction the gradient shard is copied back. The optimizer step then runs on the CPU.

On a CPU-only run the device *is* the host, so both copies are the identity; the bookkeeping
(``CommStats`` counts ``offload_h2d``/``offload_d2h`` bytes) still runs, which is how the path is
exercised by the CPU tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flatshard.core.streams import host_waits_for_device


@dataclass(frozen=True)
class CPUOffload:
    """Offload settings for ``fs.shard(offload=...)``."""

    params: bool = True
    """Keep sharded parameters, gradients and optimizer state in CPU memory."""

    def __post_init__(self) -> None:
        if not isinstance(self.params, bool):
            raise ValueError(f"CPUOffload(params={self.params!r}): pass True or False")


def storage_device(device: torch.device, offload: CPUOffload | None) -> torch.device:
    """Where shards live: the host when offloading, else the compute device."""
    return torch.device("cpu") if offload is not None and offload.params else device


def pin_if_useful(tensor: torch.Tensor, compute: torch.device) -> torch.Tensor:
    """Page-locked host memory makes host-to-device copies asynchronous (CUDA only)."""
    if compute.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory()
    return tensor


def copy_to_host(tensor: torch.Tensor, host: torch.device) -> torch.Tensor:
    """``tensor`` in host memory, without blocking the host: a copy queued on the current
    stream into (on CUDA) pinned memory, never a ``.to("cpu")`` (which waits for the device
    there). The caller must ``wait_for_host_copies`` before the host reads the result (the
    end of backward does, once for all of them, so the copies overlap each other and the rest
    of the reduction instead of draining the device one group at a time). A tensor already
    on the host (a CPU-only run: the device *is* the host) is returned as it is."""
    if tensor.device == host:
        return tensor
    out = torch.empty(
        tensor.shape, dtype=tensor.dtype, device=host, pin_memory=tensor.device.type == "cuda"
    )
    out.copy_(tensor, non_blocking=True)
    return out


def to_compute(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-computed ``tensor`` (statistics of offloaded gradients) on the compute
    ``device`` without waiting for it: pinned on CUDA, so the copy is asynchronous (a plain
    ``.to(device)`` waits for the stream there). ``tensor`` itself when already there."""
    if tensor.device == device:
        return tensor
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def wait_for_host_copies(device: torch.device) -> None:
    """Block the host until the copies ``copy_to_host`` queued on ``device`` are done (an
    event after them on the current stream; nothing to wait for off CUDA)."""
    host_waits_for_device(device)
