"""``flatshard estimate``: per-rank memory and step time of a model on a layout.

Pure Python (no torch needed for the arithmetic); validated against flatshard's measured memory
(:mod:`flatshard.estimate.measure`). See ``docs/estimate.md``.
"""

from .memory import Activations, MemoryEstimate, Phase, activations, estimate_memory
from .spec import DEVICES, STRATEGIES, Device, Layout, ModelSpec, Precision, Workload

__all__ = [
    "DEVICES",
    "STRATEGIES",
    "Activations",
    "Device",
    "Layout",
    "MemoryEstimate",
    "ModelSpec",
    "Phase",
    "Precision",
    "Workload",
    "activations",
    "estimate_memory",
]
