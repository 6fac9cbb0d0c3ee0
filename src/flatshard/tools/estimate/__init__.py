"""``flatshard estimate``: per-rank memory and step time of a model on a layout.

Pure Python (no torch needed for the arithmetic); validated against flatshard's measured memory
(:mod:`flatshard.tools.estimate.measure`). See ``docs/estimate.md``.
"""

from flatshard.tools.estimate.activations import Activations, activations
from flatshard.tools.estimate.cli import estimate, main
from flatshard.tools.estimate.devices import DEVICES, Device
from flatshard.tools.estimate.memory import MemoryEstimate, Phase, estimate_memory
from flatshard.tools.estimate.reserved import Reserved, estimate_reserved
from flatshard.tools.estimate.spec import STRATEGIES, Layout, ModelSpec, Precision, Workload
from flatshard.tools.estimate.steptime import StepTime, estimate_time

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
    "Reserved",
    "StepTime",
    "Workload",
    "activations",
    "estimate",
    "estimate_memory",
    "estimate_reserved",
    "estimate_time",
    "main",
]
