"""flatshard: Fully Sharded Data Parallel (ZeRO-3) training for PyTorch.

Parameters live in one flat buffer per unit; each rank owns a slice of it and the optimizer
steps on that slice. See ``fs.shard``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# [Note: a light import]
# ``import flatshard`` imports nothing, not even torch: each public name is loaded from its
# module at its first use (PEP 562). torch itself imports tqdm when it is installed
# (``torch.hub``), so an eager ``import torch`` here would put tqdm in ``sys.modules`` for
# every ``import flatshard``. ``fs.shard`` and the rest load exactly what they need.
_WHERE = {
    "no_sync": "accumulate",
    "checkpoint_activations": "features.activation_checkpoint",
    "precompute_float8_scales": "features.float8_scales",
    "ShardingStrategy": "api",
    "shard": "api",
    "unshard": "core.teardown",
    "SaveHandle": "checkpoint",
    "export_checkpoint": "checkpoint",
    "export_safetensors": "checkpoint",
    "latest_checkpoint": "checkpoint",
    "load": "checkpoint",
    "load_full_state_dict_from_file": "checkpoint",
    "save": "checkpoint",
    "save_pretrained": "checkpoint",
    "Coalesce": "coalesce",
    "clip_grad_norm_": "optim.grad_norm",
    "GradScaler": "optim.grad_scaler",
    "MemoryStats": "introspect",
    "UnitInfo": "introspect",
    "comm_stats": "introspect",
    "is_sharded": "introspect",
    "memory_stats": "introspect",
    "units": "introspect",
    "register_method": "methods",
    "CPUOffload": "offload",
    "pipeline_step": "parallel.pipeline_step",
    "tie_across_stages": "parallel.pipeline_tied",
    "full_optimizer_state_dict": "checkpoint.optim_state",
    "load_full_optimizer_state_dict": "checkpoint.optim_state",
    "FragmentInfo": "core.params",
    "fragment_info": "core.params",
    "full_shape": "core.params",
    "Comm": "precision",
    "MixedPrecision": "precision",
    "Prefetch": "prefetch",
    "full_state_dict": "checkpoint.full_state",
    "load_full_state_dict": "checkpoint.full_state",
    "summon_full_params": "checkpoint.full_state",
}
_SUBPACKAGES = ("optim", "wrap")

if TYPE_CHECKING:  # what type checkers and IDEs see: the eager imports
    from flatshard import optim, wrap
    from flatshard.accumulate import no_sync
    from flatshard.api import ShardingStrategy, shard
    from flatshard.checkpoint import (
        SaveHandle,
        export_checkpoint,
        export_safetensors,
        latest_checkpoint,
        load,
        load_full_state_dict_from_file,
        save,
        save_pretrained,
    )
    from flatshard.checkpoint.full_state import (
        full_state_dict,
        load_full_state_dict,
        summon_full_params,
    )
    from flatshard.checkpoint.optim_state import (
        full_optimizer_state_dict,
        load_full_optimizer_state_dict,
    )
    from flatshard.coalesce import Coalesce
    from flatshard.core.params import FragmentInfo, fragment_info, full_shape
    from flatshard.core.teardown import unshard
    from flatshard.features.activation_checkpoint import checkpoint_activations
    from flatshard.features.float8_scales import precompute_float8_scales
    from flatshard.introspect import (
        MemoryStats,
        UnitInfo,
        comm_stats,
        is_sharded,
        memory_stats,
        units,
    )
    from flatshard.methods import register_method
    from flatshard.offload import CPUOffload
    from flatshard.optim.grad_norm import clip_grad_norm_
    from flatshard.optim.grad_scaler import GradScaler
    from flatshard.parallel.pipeline_step import pipeline_step
    from flatshard.parallel.pipeline_tied import tie_across_stages
    from flatshard.precision import Comm, MixedPrecision
    from flatshard.prefetch import Prefetch


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        value = importlib.import_module(f".{name}", __name__)
    elif name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    else:
        raise AttributeError(f"module 'flatshard' has no attribute {name!r}")
    globals()[name] = value  # loaded once; later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "CPUOffload",
    "Coalesce",
    "Comm",
    "FragmentInfo",
    "GradScaler",
    "MemoryStats",
    "MixedPrecision",
    "Prefetch",
    "SaveHandle",
    "ShardingStrategy",
    "UnitInfo",
    "checkpoint_activations",
    "clip_grad_norm_",
    "comm_stats",
    "export_checkpoint",
    "export_safetensors",
    "fragment_info",
    "full_optimizer_state_dict",
    "full_shape",
    "full_state_dict",
    "is_sharded",
    "latest_checkpoint",
    "load",
    "load_full_optimizer_state_dict",
    "load_full_state_dict",
    "load_full_state_dict_from_file",
    "memory_stats",
    "no_sync",
    "optim",
    "pipeline_step",
    "precompute_float8_scales",
    "register_method",
    "save",
    "save_pretrained",
    "shard",
    "summon_full_params",
    "tie_across_stages",
    "units",
    "unshard",
    "wrap",
]
__version__ = "0.1.0"
