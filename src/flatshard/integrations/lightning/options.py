"""The strategy options both Lightning flavours take, checked once, and the process group."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.seed import reset_seed

from flatshard.precision import MixedPrecision

STATE_DICT_TYPES = ("sharded", "full")


@dataclass
class StrategyOptions:
    """``FlatshardStrategy(...)``'s arguments: ``shard_kwargs`` go to ``fs.shard`` as given."""

    shard_kwargs: dict[str, Any] = field(default_factory=dict)
    state_dict_type: str = "sharded"
    process_group_backend: str | None = None
    timeout: timedelta | None = default_pg_timeout

    def __post_init__(self) -> None:
        if self.state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(
                f"FlatshardStrategy(state_dict_type={self.state_dict_type!r}): use 'sharded' "
                "(fs.save: every rank writes its shards) or 'full' (one file on rank 0)"
            )
        if "model" in self.shard_kwargs:
            raise ValueError("FlatshardStrategy: the model is the strategy's; do not pass model=")

    def shard_kwargs_with(self, precision_mp: MixedPrecision | None) -> dict[str, Any]:
        """fs.shard's kwargs; the precision plugin's mixed precision unless one was given."""
        kwargs = dict(self.shard_kwargs)
        if kwargs.get("mixed_precision") is None and precision_mp is not None:
            kwargs["mixed_precision"] = precision_mp
        return kwargs


def collect_options(
    policy: Any,
    strategy: Any,
    mixed_precision: MixedPrecision | None,
    state_dict_type: str,
    process_group_backend: str | None,
    timeout: timedelta | None,
    shard_kwargs: dict[str, Any],
) -> StrategyOptions:
    kwargs = dict(shard_kwargs)
    if policy is not None:
        kwargs["policy"] = policy
    if strategy is not None:
        kwargs["strategy"] = strategy
    if mixed_precision is not None:
        kwargs["mixed_precision"] = mixed_precision
    return StrategyOptions(kwargs, state_dict_type, process_group_backend, timeout)


def init_process_group(lightning_strategy: Any, options: StrategyOptions) -> str:
    """Lightning's own way to bring up torch.distributed for this strategy; the backend."""
    reset_seed()
    lightning_strategy._set_world_ranks()
    device = lightning_strategy.root_device
    backend = options.process_group_backend or _get_default_process_group_backend_for_device(device)
    kwargs: dict[str, Any] = {"timeout": options.timeout}
    kwargs["device_id"] = device if device.type != "cpu" else None
    _init_dist_connection(lightning_strategy.cluster_environment, backend, **kwargs)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return backend
