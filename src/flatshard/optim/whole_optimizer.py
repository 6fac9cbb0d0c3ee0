"""What ``fs.optim.Muon`` and ``fs.optim.Adafactor`` share as ``torch.optim.Optimizer``s: one
sharded model per optimizer (its collectives' counters and timeout), the whole-parameter facts
of each fragment (cached, rebuilt if a parameter object changes), the closure, and the
parameters that take part in a step."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.optim.optimizer import Optimizer

from flatshard.optim.whole import WholeParam, check_one_model, comm_of, whole_param


class WholeParamOptimizer(Optimizer):
    """Base of the optimizers that need each parameter's whole matrix."""

    name = "fs.optim.WholeParamOptimizer"

    def _setup_whole(self) -> None:
        """Call at the end of ``__init__``, once the param groups exist."""
        every = [p for g in self.param_groups for p in g["params"]]
        check_one_model(every, self.name)
        self._comm = comm_of(every)
        self._wholes: dict[int, WholeParam] = {}

    @staticmethod
    def _run_closure(closure: Callable[[], Any] | None) -> Any:
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _with_grads(self) -> Iterator[tuple[torch.Tensor, dict[str, Any]]]:
        """(parameter, its group) for every parameter that has a gradient, in group order."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    yield p, group

    def _whole_of(self, p: torch.Tensor) -> WholeParam:
        """``p``'s whole-parameter facts; refuses what torch's optimizers refuse."""
        if torch.is_complex(p):
            raise RuntimeError(f"{self.name} does not support complex parameters")
        if p.grad.is_sparse:
            raise RuntimeError(f"{self.name} does not support sparse gradients")
        whole = self._wholes.get(id(p))
        if whole is None or whole.param is not p:
            whole = self._wholes[id(p)] = whole_param(p)
        return whole
