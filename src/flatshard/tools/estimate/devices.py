"""The hardware: peak FLOP/s, collective bandwidth and memory of one accelerator (or CPU core)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEVICES", "Device"]


@dataclass(frozen=True)
class Device:
    """Peak dense FLOP/s, collective bus bandwidth and memory of one accelerator."""

    name: str
    flops: dict[str, float]
    """Peak dense FLOP/s by compute dtype (``fp32`` without TF32, ``bf16``)."""
    intra_gbps: float
    """Bus bandwidth (GB/s, nccl-tests' busbw) within a node."""
    inter_gbps: float
    """Bus bandwidth (GB/s) per rank when a collective spans nodes."""
    per_node: int
    """Ranks per node."""
    memory_gib: float | None
    """Usable memory per rank; ``None``: no fit check."""
    mfu: float = 0.4
    """Default model FLOPs utilisation."""
    overlap: float = 0.9
    """Default share of the overlappable communication hidden under compute."""


DEVICES: dict[str, Device] = {
    "h100": Device("h100", {"bf16": 989e12, "fp32": 67e12}, 360.0, 45.0, 8, 80.0),
    "h200": Device("h200", {"bf16": 989e12, "fp32": 67e12}, 360.0, 45.0, 8, 141.0),
    "a100": Device("a100", {"bf16": 312e12, "fp32": 19.5e12}, 230.0, 22.0, 8, 80.0),
    # This 2-core box, one core per rank, Gloo over loopback; calibrated on the anchor GPT's
    # step (docs/performance.md), see docs/estimate.md. Gloo's threads share the cores: little
    # overlap.
    "cpu": Device("cpu", {"bf16": 3.7e11, "fp32": 1.6e11}, 0.7, 0.7, 64, None, 0.5, 0.3),
}
"""Defaults for ``--gpu``; every figure can be overridden on the command line."""
