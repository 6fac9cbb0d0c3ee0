"""Optimizers and optimizer helpers for sharded models.

``param_groups`` builds weight-decay groups by the original shapes (fragments are 1-D).

``AdamWKahan`` keeps bf16 parameters and moments (8 bytes per parameter on the optimizer side)
and adds each fp32-computed update with Kahan compensation or stochastic rounding, so updates
far below bf16's resolution still accumulate. ``kahan_add_`` and ``stochastic_round`` are the
building blocks.
"""

from .groups import param_groups
from .kahan import AdamWKahan
from .rounding import kahan_add_, stochastic_round

__all__ = ["AdamWKahan", "kahan_add_", "param_groups", "stochastic_round"]
