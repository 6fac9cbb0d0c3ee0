"""flatshard: Fully Sharded Data Parallel (ZeRO-3) training for PyTorch.

Parameters live in one flat buffer per unit; each rank owns a slice of it and the optimizer
steps on that slice. See ``fs.shard``.
"""

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
from .precision import MixedPrecision
from .prefetch import Prefetch
from .state_dict import full_state_dict, load_full_state_dict, summon_full_params

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
    "register_method",
    "save",
    "save_pretrained",
    "shard",
    "summon_full_params",
    "units",
    "wrap",
]
__version__ = "0.1.0"
