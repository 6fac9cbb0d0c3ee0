"""Optimizers for low-precision training without an fp32 master copy.

``AdamWKahan`` keeps bf16 parameters and moments (8 bytes per parameter on the optimizer side)
and adds each fp32-computed update with Kahan compensation or stochastic rounding, so updates
far below bf16's resolution still accumulate. ``kahan_add_`` and ``stochastic_round`` are the
building blocks.
"""

from .kahan import AdamWKahan
from .rounding import kahan_add_, stochastic_round

__all__ = ["AdamWKahan", "kahan_add_", "stochastic_round"]
