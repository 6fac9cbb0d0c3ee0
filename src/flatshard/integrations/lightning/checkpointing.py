"""Checkpoints of both Lightning flavours: sharded through ``fs.save``/``fs.load``, or one full
file on rank 0 (``state_dict_type="full"``: the unsharded model's ``state_dict`` and torch's
full optimizer layout, loadable without flatshard)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flatshard import checkpoint as fs_checkpoint
from flatshard.checkpoint.full_state import full_state_dict
from flatshard.checkpoint.optim_state import (
    full_optimizer_state_dict,
    load_full_optimizer_state_dict,
)


def save(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any],
    state_dict_type: str,
    keys: tuple[str, str] = ("model", "optimizer"),
    optimizer_in_list: bool = False,
) -> None:
    """Every rank calls it. ``keys``: where a full file puts the model and optimizer (Lightning's
    Trainer files hold a list of optimizer states: ``optimizer_in_list``)."""
    if state_dict_type == "sharded":
        fs_checkpoint.save(path, model=model, optimizer=optimizer, extra=extra)
        return
    weights = full_state_dict(model)
    optim = full_optimizer_state_dict(model, optimizer) if optimizer is not None else None
    if dist.get_rank() == 0:
        content = {**extra, keys[0]: weights}
        if optim is not None:
            content[keys[1]] = [optim] if optimizer_in_list else optim
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{path}.tmp")
        torch.save(content, tmp)
        tmp.replace(path)
    dist.barrier()


def load(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    keys: tuple[str, str] = ("model", "optimizer"),
    strict: bool = True,
    optimizer_in_list: bool = False,
) -> dict[str, Any]:
    """Load a sharded directory or a full file; return the extras (rank 0's, on every rank)."""
    path = Path(path)
    if path.is_dir():
        return fs_checkpoint.load(path, model=model, optimizer=optimizer, strict=strict)
    if not path.is_file():
        raise FileNotFoundError(
            f"no checkpoint at {path}: pass a directory written by fs.save "
            "or a file written with state_dict_type='full'"
        )
    content = (
        torch.load(path, map_location="cpu", weights_only=True) if dist.get_rank() == 0 else {}
    )
    from flatshard.checkpoint.full_state import load_full_state_dict

    load_full_state_dict(model, content.pop(keys[0], {}), strict=strict)
    osd = content.pop(keys[1], {}) if dist.get_rank() == 0 else {}
    if optimizer_in_list and osd:
        osd = osd[0]
    if optimizer is not None:
        load_full_optimizer_state_dict(model, optimizer, osd)
    holder = [content]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
