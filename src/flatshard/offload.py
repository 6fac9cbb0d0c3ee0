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
    """``tensor`` in host memory. From a CUDA device the copy is asynchronous, into pinned
    memory: the caller must ``wait_for_host_copies`` before the host reads the result (the
    end of backward does, once for all of them, so the copies overlap each other and the
    rest of the reduction instead of draining the device one group at a time)."""
    if tensor.device.type != "cuda":
        return tensor.to(host)
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device=host, pin_memory=True)
    out.copy_(tensor, non_blocking=True)
    return out


def wait_for_host_copies(device: torch.device) -> None:
    """Block the host until the copies ``copy_to_host`` queued on ``device`` are done (an
    event after them on the current stream; nothing to wait for off CUDA)."""
    if device.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        event.synchronize()
