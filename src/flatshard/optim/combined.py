"""``fs.optim.Combined``: several optimizers over disjoint parameters, used as one.

Muon takes the hidden matrices only; its authors train the rest (embeddings, the head, 1-D
parameters) with AdamW. Trainers, LR schedulers and checkpoints expect one optimizer:
``Combined(adamw, muon)`` is one. Its ``param_groups`` are its parts' groups, in order (the
same dicts: a scheduler's LR changes reach the parts), its ``state`` their states merged, and
its ``state_dict`` the usual positional format over all of them, so ``fs.save``/``fs.load`` and
``torch.optim.lr_scheduler`` treat it like any optimizer.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch.optim.optimizer import Optimizer

__all__ = ["Combined"]


class Combined(Optimizer):
    """One optimizer made of ``optimizers`` (disjoint parameters); each steps its own."""

    def __init__(self, *optimizers: Optimizer) -> None:
        if not optimizers or not all(isinstance(o, Optimizer) for o in optimizers):
            raise TypeError(
                f"fs.optim.Combined(*optimizers) takes torch optimizers, got "
                f"{[type(o).__name__ for o in optimizers]}"
            )
        seen: set[int] = set()
        for o in optimizers:
            for p in (p for g in o.param_groups for p in g["params"]):
                if id(p) in seen:
                    raise ValueError(
                        f"fs.optim.Combined: a parameter of shape {tuple(p.shape)} is in two of "
                        "the optimizers; give each parameter to exactly one"
                    )
                seen.add(id(p))
        # Optimizer.__init__ would build groups of its own: set what its other methods read.
        self.optimizers = list(optimizers)
        self.defaults: dict[str, Any] = {}
        for hooks in (
            "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
            "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks",
        ):  # fmt: skip
            setattr(self, hooks, OrderedDict())

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict:  # type: ignore[override]
        """The parts' states, merged (read-only view: load through ``load_state_dict``)."""
        return {p: s for o in self.optimizers for p, s in o.state.items()}

    def step(self, closure=None):  # torch's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.optimizers:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise TypeError("fs.optim.Combined: add the param group to one of its optimizers")

    def state_dict(self) -> dict[str, Any]:
        """torch's format: parameters numbered across all the parts' groups, in order."""
        out: dict[str, Any] = {"state": {}, "param_groups": []}
        offset = 0
        for o in self.optimizers:
            sd = o.state_dict()
            out["state"].update({i + offset: s for i, s in sd["state"].items()})
            for g in sd["param_groups"]:
                out["param_groups"].append({**g, "params": [i + offset for i in g["params"]]})
            offset += sum(len(g["params"]) for g in o.param_groups)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"fs.optim.Combined: the state dict has {len(groups)} param groups, this "
                f"optimizer {len(self.param_groups)}; build it from the same optimizers"
            )
        first = 0
        for o in self.optimizers:
            mine = groups[first : first + len(o.param_groups)]
            first += len(o.param_groups)
            ids = {i for g in mine for i in g["params"]}
            base = min(ids, default=0)
            o.load_state_dict({
                "state": {i - base: s for i, s in state_dict["state"].items() if i in ids},
                "param_groups": [{**g, "params": [i - base for i in g["params"]]} for g in mine],
            })  # fmt: skip

    def __repr__(self) -> str:
        return f"Combined({', '.join(type(o).__name__ for o in self.optimizers)})"
