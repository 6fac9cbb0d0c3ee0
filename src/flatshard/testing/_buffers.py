"""Buffers of a collective in flight (``nccl_semantics``): poisoning, aliasing, snapshots."""

from __future__ import annotations

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (NaN != NaN, so values cannot be compared; bits can)."""
    flat = t.detach().reshape(-1)
    return flat.contiguous().view(torch.uint8) if flat.numel() else flat.view(torch.uint8)


def poison(t: torch.Tensor) -> None:
    data = t.data  # as NCCL's kernels: no autograd version bump
    if data.is_floating_point() or data.is_complex():
        data.fill_(float("nan"))
    elif data.dtype == torch.bool:
        data.fill_(True)
    else:
        info = torch.iinfo(data.dtype)
        data.fill_(info.min if info.min < 0 else info.max)


def byte_range(t: torch.Tensor) -> tuple[int, int, int]:
    start = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
    extent = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True)) + 1
    return t.untyped_storage().data_ptr(), start, start + extent * t.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not a.numel() or not b.numel():
        return False
    sa, a0, a1 = byte_range(a)
    sb, b0, b1 = byte_range(b)
    return sa == sb and a0 < b1 and b0 < a1


class Watched:
    """One caller tensor of a collective in flight: its storage and bits at issue."""

    def __init__(self, role: str, tensor: torch.Tensor) -> None:
        self.role, self.tensor = role, tensor
        self.storage = tensor.untyped_storage()
        self.ptr, self.nbytes = self.storage.data_ptr(), self.storage.nbytes()
        self.bits = bits(tensor).clone()

    def problem(self) -> str | None:
        now = (self.storage.data_ptr(), self.storage.nbytes())
        if now != (self.ptr, self.nbytes):
            return (
                f"its {self.role} buffer was freed or resized while in flight "
                f"({self.nbytes} bytes at issue, {now[1]} at wait)"
            )
        if not torch.equal(bits(self.tensor), self.bits):
            what = "input was modified" if self.role == "input" else "output was written"
            return f"its {what} while in flight (NCCL reads/writes it until wait())"
        return None
