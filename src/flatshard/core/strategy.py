"""Sharding strategies: each one a row of ``STRATEGIES``, the one place that defines them.

A strategy says which groups of the mesh the parameters are *sharded* over and which they are
*replicated* over, and whether a unit frees its gathered parameters after forward. Everything
else follows from the resulting ``Topology`` (core/mesh.py): gathers run over the shard
group, the reduction (core/reduce.py) reduce-scatters over the shard group and all-reduces
over the replicate group, and size-one groups issue nothing. Adding a strategy that is such a
combination is one enum member and one row here (and its tests).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ShardingStrategy(str, enum.Enum):
    FULL_SHARD = "full_shard"  # ZeRO-3: reshard parameters after forward
    SHARD_GRAD_OP = "shard_grad_op"  # ZeRO-2: keep them gathered until the unit's backward
    NO_SHARD = "no_shard"  # DDP semantics
    HYBRID_SHARD = "hybrid_shard"  # shard within a group, replicate across groups


class MeshRole(enum.Enum):
    """What a dimension of the mesh is to a strategy."""

    SHARD = "shard"  # parameters are split over it
    REPLICATE = "replicate"  # every rank holds the same shard; gradients are averaged over it


@dataclass(frozen=True)
class StrategySpec:
    dims: tuple[MeshRole, ...]
    """The mesh it takes, dimension by dimension (one role: a 1-D mesh or a process group)."""
    reshard_after_forward: bool
    """Units (but the root) free their gathered parameters after forward (ZeRO-3)."""


STRATEGIES: dict[ShardingStrategy, StrategySpec] = {
    ShardingStrategy.FULL_SHARD: StrategySpec((MeshRole.SHARD,), True),
    ShardingStrategy.SHARD_GRAD_OP: StrategySpec((MeshRole.SHARD,), False),
    ShardingStrategy.NO_SHARD: StrategySpec((MeshRole.REPLICATE,), False),
    ShardingStrategy.HYBRID_SHARD: StrategySpec((MeshRole.REPLICATE, MeshRole.SHARD), True),
}


def reshards_after_forward(strategy: ShardingStrategy) -> bool:
    return STRATEGIES[strategy].reshard_after_forward
