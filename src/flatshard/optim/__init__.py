"""Optimizers and optimizer helpers for sharded models.

``param_groups`` builds weight-decay groups by the original shapes (fragments are 1-D).

``AdamWKahan`` keeps bf16 parameters and moments (8 bytes per parameter on the optimizer side)
and adds each fp32-computed update with Kahan compensation or stochastic rounding, so updates
far below bf16's resolution still accumulate. ``kahan_add_`` and ``stochastic_round`` are the
building blocks.

``Muon`` and ``Adafactor`` are torch's (same arguments, same math) for sharded parameters: the
whole-matrix work (Newton–Schulz; row/column statistics) is done from the whole reduced
gradient, by one owner rank per matrix for Muon, by small all-reduces for Adafactor
(docs/optimizers.md). ``muon_split`` picks the matrices Muon should take; ``Combined`` makes
Muon and an AdamW for the rest one optimizer (schedulers, ``fs.save``).
"""

from flatshard.optim.adafactor import Adafactor
from flatshard.optim.combined import Combined
from flatshard.optim.groups import muon_split, param_groups
from flatshard.optim.kahan import AdamWKahan
from flatshard.optim.muon import Muon
from flatshard.optim.rounding import kahan_add_, stochastic_round

__all__ = [
    "Adafactor",
    "AdamWKahan",
    "Combined",
    "Muon",
    "kahan_add_",
    "muon_split",
    "param_groups",
    "stochastic_round",
]
