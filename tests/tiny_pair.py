"""A seeded TinyGPT reference and its sharded copy, the pair most engine cases start from."""

from __future__ import annotations

import copy

import torch
from torch import nn

import flatshard as fs
from parity_models import Block, TinyGPT, mesh_for


def tiny_pair(strategy: str = "full_shard", **shard_kwargs) -> tuple[nn.Module, nn.Module]:
    """The reference (unsharded) and the sharded copy, one unit per Block."""
    torch.manual_seed(0)
    ref = TinyGPT()
    model = fs.shard(
        copy.deepcopy(ref),
        policy=fs.wrap.by_type(Block),
        strategy=strategy,
        mesh=mesh_for(strategy),
        **shard_kwargs,
    )
    return ref, model
