"""``flatshard estimate``: per-rank memory and step time of a model on a layout.

Pure Python (no torch needed for the arithmetic); validated against flatshard's measured memory
(:mod:`flatshard.estimate.measure`). See ``docs/estimate.md``.
"""

from .activations import Activations, activations
from .cli import estimate, main
from .devices import DEVICES, Device
from .memory import MemoryEstimate, Phase, estimate_memory
from .spec import STRATEGIES, Layout, ModelSpec, Precision, Workload
from .steptime import StepTime, estimate_time

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
    "StepTime",
    "Workload",
    "activations",
    "estimate",
    "estimate_memory",
    "estimate_time",
    "main",
]
