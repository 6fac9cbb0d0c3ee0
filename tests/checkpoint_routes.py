"""Every way users turn on activation checkpointing, applied to a parity model's copy.

Each ``Route`` changes the model the way the third-party code does it, for real: torch's
``torch.utils.checkpoint.checkpoint`` (around a unit from the parent's forward, or inside a
unit's forward; reentrant or not), torch's composable ``checkpoint(module)``, torch's
``apply_activation_checkpointing`` / ``CheckpointWrapper``, Hugging Face's
``gradient_checkpointing_enable``, and ``fs.checkpoint_activations``. The unsharded reference
keeps its activations: checkpointing must not change a single gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.utils.checkpoint import checkpoint

import flatshard as fs
from parity_models import Block


def _nothing(model: nn.Module, *_) -> None:
    return None


def _same_policy(policy):
    return policy


@dataclass(frozen=True)
class Route:
    before_shard: Callable[[nn.Module], None] = _nothing
    """Applied to the copy before ``fs.shard`` (most recipes checkpoint first)."""
    after_shard: Callable[[nn.Module, object], None] = _nothing
    """Applied after ``fs.shard``, with the case's unit policy."""
    policy: Callable[[object], object] = _same_policy
    """The wrap policy used for ``fs.shard``, from the case's one."""


def _around(reentrant: bool) -> Callable[[nn.Module], None]:
    def apply(model: nn.Module) -> None:
        model.block_call = functools.partial(checkpoint, use_reentrant=reentrant)

    return apply


def _inside(reentrant: bool, parts: str) -> Callable[[nn.Module], None]:
    def apply(model: nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, Block):
                module.checkpoint_fn = functools.partial(checkpoint, use_reentrant=reentrant)
                module.checkpoint_parts = parts

    return apply


def _composable(model: nn.Module, *_) -> None:
    from torch.distributed._composable import checkpoint as composable_checkpoint

    for module in list(model.modules()):
        if isinstance(module, Block):
            composable_checkpoint(module)


def _wrapper(model: nn.Module, *_) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))


def _wrapper_policy(policy):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return fs.wrap.by_type(CheckpointWrapper)


def _hf(reentrant: bool) -> Callable[[nn.Module], None]:
    def apply(model: nn.Module) -> None:
        model.train()
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant}
        )

    return apply


def _fs_after(model: nn.Module, policy) -> None:
    fs.checkpoint_activations(model, policy)


ROUTES: dict[str, Route] = {
    "none": Route(),
    "fs_checkpoint_activations": Route(after_shard=_fs_after),
    "around_nonreentrant": Route(before_shard=_around(False)),
    "around_reentrant": Route(before_shard=_around(True)),
    "inside_nonreentrant": Route(before_shard=_inside(False, "all")),
    "inside_nonreentrant_parts": Route(before_shard=_inside(False, "both")),
    "inside_reentrant": Route(before_shard=_inside(True, "all")),
    "inside_reentrant_parts": Route(before_shard=_inside(True, "both")),
    "inside_reentrant_mlp": Route(before_shard=_inside(True, "mlp")),
    "composable": Route(before_shard=_composable),
    "composable_after_shard": Route(after_shard=_composable),
    "checkpoint_wrapper": Route(before_shard=_wrapper),
    "checkpoint_wrapper_unit": Route(before_shard=_wrapper, policy=_wrapper_policy),
    "checkpoint_wrapper_after_shard": Route(after_shard=_wrapper),
    "hf_nonreentrant": Route(before_shard=_hf(False)),
    "hf_reentrant": Route(before_shard=_hf(True)),
}
