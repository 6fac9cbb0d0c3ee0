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
    "checkpoint_activations": "activation_checkpoint",
    "ShardingStrategy": "api",
    "shard": "api",
    "SaveHandle": "checkpoint",
    "export_checkpoint": "checkpoint",
    "export_safetensors": "checkpoint",
    "latest_checkpoint": "checkpoint",
    "load": "checkpoint",
    "load_full_state_dict_from_file": "checkpoint",
    "save": "checkpoint",
    "save_pretrained": "checkpoint",
    "Coalesce": "coalesce",
    "clip_grad_norm_": "grad_norm",
    "GradScaler": "grad_scaler",
    "MemoryStats": "introspect",
    "UnitInfo": "introspect",
    "comm_stats": "introspect",
    "is_sharded": "introspect",
    "memory_stats": "introspect",
    "units": "introspect",
    "register_method": "methods",
    "CPUOffload": "offload",
    "pipeline_step": "pipeline",
    "tie_across_stages": "pipeline_tied",
    "full_optimizer_state_dict": "optim_state",
    "load_full_optimizer_state_dict": "optim_state",
    "FragmentInfo": "params",
    "fragment_info": "params",
    "full_shape": "params",
    "MixedPrecision": "precision",
    "Prefetch": "prefetch",
    "full_state_dict": "state_dict",
    "load_full_state_dict": "state_dict",
    "summon_full_params": "state_dict",
}
_SUBPACKAGES = ("optim", "wrap")

if TYPE_CHECKING:  # what type checkers and IDEs see: the eager imports
    from . import optim, wrap
    from .accumulate import no_sync
    from .activation_checkpoint import checkpoint_activations
    from .api import ShardingStrategy, shard
    from .checkpoint import (
        SaveHandle,
        export_checkpoint,
        export_safetensors,
        latest_checkpoint,
        load,
        load_full_state_dict_from_file,
        save,
        save_pretrained,
    )
    from .coalesce import Coalesce
    from .grad_norm import clip_grad_norm_
    from .grad_scaler import GradScaler
    from .introspect import MemoryStats, UnitInfo, comm_stats, is_sharded, memory_stats, units
    from .methods import register_method
    from .offload import CPUOffload
    from .optim_state import full_optimizer_state_dict, load_full_optimizer_state_dict
    from .params import FragmentInfo, fragment_info, full_shape
    from .pipeline import pipeline_step
    from .pipeline_tied import tie_across_stages
    from .precision import MixedPrecision
    from .prefetch import Prefetch
    from .state_dict import full_state_dict, load_full_state_dict, summon_full_params


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
    "register_method",
    "save",
    "save_pretrained",
    "shard",
    "summon_full_params",
    "tie_across_stages",
    "units",
    "wrap",
]
__version__ = "0.1.0"
