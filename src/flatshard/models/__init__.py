"""The reference GPT used by ``flatshard train`` (packing-aware, FSDP-friendly).

See ``docs/data_and_model.md`` for the presets and their sizes.
"""

from flatshard.models.block import MLP, Attention, Block
from flatshard.models.config import PRESETS, GPTConfig
from flatshard.models.gpt import GPT
from flatshard.models.rope import RotaryEmbedding, apply_rotary, positions_from_cu_seqlens
from flatshard.models.sampling import generate

__all__ = [
    "GPT",
    "MLP",
    "PRESETS",
    "Attention",
    "Block",
    "GPTConfig",
    "RotaryEmbedding",
    "apply_rotary",
    "generate",
    "positions_from_cu_seqlens",
]
from flatshard.models.moe import Experts, MoEConfig, MoEGPT, shard_experts  # noqa: F401
