"""Lightning integration (``pip install flatshard[lightning]``).

Importing this module registers ``strategy="flatshard"`` with both ``lightning.Trainer`` and
``lightning.Fabric``. The strategy classes are ``FlatshardStrategy`` (Trainer) and
``flatshard.integrations.lightning.fabric.FlatshardStrategy`` (Fabric), as Lightning has one
``FSDPStrategy`` per flavour (one class cannot serve both: [Note: one class per flavour] in
``base.py``). See docs/integrations/lightning.md.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as _FABRIC_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry as _TRAINER_REGISTRY

from flatshard.integrations.lightning import fabric
from flatshard.integrations.lightning.precision import FabricFlatshardPrecision, FlatshardPrecision
from flatshard.integrations.lightning.trainer import FlatshardStrategy

FabricFlatshardStrategy = fabric.FlatshardStrategy

FabricFlatshardStrategy.register_strategies(_FABRIC_REGISTRY)
FlatshardStrategy.register_strategies(_TRAINER_REGISTRY)

__all__ = [
    "FabricFlatshardPrecision",
    "FabricFlatshardStrategy",
    "FlatshardPrecision",
    "FlatshardStrategy",
]
