"""What every trainer integration needs: shard a module, re-point an optimizer built before
sharding, split a trainer's checkpoint state into model / optimizer / small extras.

Light: imports neither lightning nor transformers, so both integrations share it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from flatshard import api, wrap
from flatshard.introspect import is_sharded


def no_split_policy(model: nn.Module) -> Any:
    """``fs.wrap.by_type`` of a transformers model's ``_no_split_modules`` classes (its decoder
    layers), or ``fs.wrap.auto()`` when it names none that it contains. Reads names only:
    transformers is not imported."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    return wrap.by_type(*sorted(classes, key=lambda c: c.__name__)) if classes else wrap.auto()


def parameter_names(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first name, taken before sharding (``fs.shard`` replaces them)."""
    names: dict[int, str] = {}
    for name, param in module.named_parameters():
        names.setdefault(id(param), name)
    return names


def shard_module(module: nn.Module, shard_kwargs: dict[str, Any]) -> nn.Module:
    """``fs.shard(module, **shard_kwargs)`` unless it is sharded already (then it is kept)."""
    if is_sharded(module):
        return module
    return api.shard(module, **shard_kwargs)


def repoint_optimizer(
    optimizer: torch.optim.Optimizer, names_before: dict[int, str], module: nn.Module
) -> None:
    """Make an optimizer built on the unsharded parameters step on the fragments instead.

    Only possible while it holds no state (nothing was stepped yet): its param groups keep
    their hyperparameters, each parameter is swapped for the fragment of the same name.
    """
    if optimizer.state:
        raise ValueError(
            f"{type(optimizer).__name__} already has state for the unsharded parameters; build "
            "the optimizer after the model is set up (sharded), or before its first step"
        )
    fragments = dict(module.named_parameters())
    for group in optimizer.param_groups:
        swapped = []
        for param in group["params"]:
            name = names_before.get(id(param))
            if name is None or name not in fragments:
                raise ValueError(
                    f"{type(optimizer).__name__} holds a parameter of shape "
                    f"{tuple(param.shape)} that is not in the module being sharded; build the "
                    "optimizer from this module's parameters"
                )
            swapped.append(fragments[name])
        group["params"] = swapped


def references_fragments(optimizer: torch.optim.Optimizer, module: nn.Module) -> bool:
    fragments = {id(p) for p in module.parameters()}
    return all(id(p) in fragments for g in optimizer.param_groups for p in g["params"])


def split_state(
    state: dict[str, Any], stateful: Iterable[type] = ()
) -> tuple[tuple[str, nn.Module] | None, tuple[str, torch.optim.Optimizer] | None, dict]:
    """(key, sharded module), (key, optimizer) and everything else of a trainer's state dict.

    flatshard saves one model and one optimizer per checkpoint; a second of either is a
    ``ValueError`` naming both keys. Objects with ``state_dict()`` (schedulers, scalers) are
    stored through it.
    """
    model = optimizer = None
    rest: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, nn.Module) and is_sharded(value):
            if model is not None:
                raise ValueError(f"checkpoint state has two sharded modules: {model[0]!r}, {key!r}")
            model = (key, value)
        elif isinstance(value, torch.optim.Optimizer):
            if optimizer is not None:
                raise ValueError(
                    f"checkpoint state has two optimizers ({optimizer[0]!r}, {key!r}); flatshard "
                    "saves one per checkpoint: use one optimizer with several param groups"
                )
            optimizer = (key, value)
        elif isinstance(value, nn.Module):
            raise ValueError(
                f"checkpoint state[{key!r}] is a module that is not sharded; pass the module the "
                "strategy set up (fabric.setup(model) / the trainer's model)"
            )
        elif hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
            rest[key] = value.state_dict()
        else:
            rest[key] = value
    return model, optimizer, rest


def restore_rest(state: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    """Put the saved extras back into ``state`` (stateful objects in place); return the
    saved entries ``state`` did not ask for (Lightning's "remainder")."""
    remainder = dict(saved)
    for key, value in list(state.items()):
        if key not in remainder or isinstance(value, nn.Module | torch.optim.Optimizer):
            continue
        if hasattr(value, "load_state_dict") and hasattr(value, "state_dict"):
            value.load_state_dict(remainder.pop(key))
        else:
            state[key] = remainder.pop(key)
    return remainder


__all__ = [
    "is_sharded",
    "no_split_policy",
    "parameter_names",
    "references_fragments",
    "repoint_optimizer",
    "restore_rest",
    "shard_module",
    "split_state",
]
