"""Refuse, before their first step, the torch optimizers that cannot be exact on fragments.

[Note: the optimizer guard]
Most ``torch.optim`` optimizers are elementwise: stepping on this rank's 1-D fragments gives
the unsharded update exactly. A few need the whole parameter (Adafactor's row/column factors,
LBFGS's line search over all parameters) or a kind of gradient flatshard does not produce
(SparseAdam). Unchecked they crash deep inside torch or, worse, run and diverge silently. So
``fs.shard`` registers (once per process) a global optimizer step pre-hook that, on the first
step of each optimizer holding flatshard fragments, raises a ``TypeError`` naming the
optimizer and what to use instead, and a ``ValueError`` for the classic weight-decay trap
(``p.dim() >= 2`` finds no matrix among 1-D fragments). The hook is stateless apart from a
flag on each optimizer and ignores optimizers without fragments, so it is safe for other
models in the same process. (torch.optim.Muon refuses 1-D parameters in its constructor by
itself; the guard still names it, for one that got fragments through ``add_param_group``.)
Adafactor and Muon have flatshard versions that are exact on shards (``fs.optim.Adafactor``,
``fs.optim.Muon``): the message points there. They are other classes, never refused here.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import Optimizer, register_optimizer_step_pre_hook

from flatshard.core.params import full_shape, is_fragment
from flatshard.parallel.plain_schedule import refuse_plain_schedule

CHECKED = "_flatshard_checked"

WHOLE_PARAMETER = {
    "Adafactor": (
        "its second-moment estimate factors each matrix into row and column statistics and "
        "scales by the parameter's RMS, which need the whole matrix, not a 1-D fragment"
    ),
    "LBFGS": (
        "its closure-driven line search takes dot products and norms over all parameters, "
        "which each rank would compute on its own shard"
    ),
    "SparseAdam": "it needs sparse gradients, and flatshard's sharded gradients are dense",
    "Muon": ("it orthogonalises each whole 2-D matrix (Newton–Schulz), not a 1-D fragment"),
}
# Refused torch optimizers that flatshard has an exact sharded version of.
FLATSHARD_VERSION = {"Adafactor": "fs.optim.Adafactor", "Muon": "fs.optim.Muon"}
INSTEAD = (
    "Use an elementwise optimizer instead (torch.optim.AdamW, Adam, SGD, RMSprop, Adagrad, "
    "...: they are exact on shards), or train this model without fs.shard"
)

_registered = False


def guard_optimizers() -> None:
    """Register the guard (idempotent)."""
    global _registered
    if not _registered:
        register_optimizer_step_pre_hook(_check_first_step)
        _registered = True


def _check_first_step(optimizer: Optimizer, args, kwargs) -> None:
    if getattr(optimizer, CHECKED, False):
        return
    groups = optimizer.param_groups
    if any(is_fragment(p) for g in groups for p in g["params"]):
        name = _refused_torch_class(optimizer)
        if name is not None:
            instead = (
                f"Use {FLATSHARD_VERSION[name]} (same arguments, exact on shards). Or: {INSTEAD}"
                if name in FLATSHARD_VERSION
                else INSTEAD
            )
            raise TypeError(
                f"torch.optim.{name} cannot step on a sharded model's parameters: "
                f"{WHOLE_PARAMETER[name]}. {instead}."
            )
        _check_weight_decay_groups(groups)
        refuse_plain_schedule([p for g in groups for p in g["params"]])
    setattr(optimizer, CHECKED, True)


def _refused_torch_class(optimizer: Optimizer) -> str | None:
    """The name of the refused ``torch.optim`` class ``optimizer`` is an instance of, if any
    (a subclass counts; flatshard's own ``fs.optim.Muon``/``Adafactor`` are other classes)."""
    for name in WHOLE_PARAMETER:
        cls = getattr(torch.optim, name, None)
        if cls is not None and isinstance(optimizer, cls):
            return name
    return None


def _check_weight_decay_groups(groups: list[dict]) -> None:
    """An empty group that asks for weight decay while the matrices sit in a group without it:
    the signature of grouping by ``p.dim()`` on 1-D fragments."""
    for i, group in enumerate(groups):
        if group["params"] or not group.get("weight_decay"):
            continue
        matrices = [
            p
            for g in groups
            if not g.get("weight_decay")
            for p in g["params"]
            if is_fragment(p) and len(full_shape(p)) >= 2
        ]
        if matrices:
            raise ValueError(
                f"optimizer param group {i} asks for weight_decay={group['weight_decay']} but "
                f"holds no parameter, while {len(matrices)} matrices get none: after fs.shard "
                "every parameter is a 1-D fragment, so p.dim() >= 2 finds nothing. Group by "
                "the original shape: fs.optim.param_groups(model, weight_decay=...) or "
                "len(fs.full_shape(p)) >= 2"
            )
