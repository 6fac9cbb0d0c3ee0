"""``fs.optim.Muon``: ``torch.optim.Muon`` on a sharded model's fragments, distributed.

Per step and parameter: the momentum (elementwise) on this rank's fragment, then the
Newton–Schulz orthogonalisation of the whole matrix, done once, by one owner rank of the shard
group, then the update applied to every fragment. Owners are assigned largest matrix first to
the least loaded rank (``whole.assign_owners``); round k holds every rank's k-th matrix, and one
all-to-all per round gathers each owner's matrix from the fragments (bf16: torch casts to bf16
before Newton–Schulz anyway, so this is exact), another scatters the orthogonalised update back
(see ``muon_rounds.py``). A rank holds at most a few of its owned full matrices at a time,
never the model's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from flatshard.core.params import fragment_tag
from flatshard.optim.muon_rounds import Job, run_jobs
from flatshard.optim.newton_schulz import ADJUST_LR_FNS, EPS, NS_COEFFICIENTS, NS_STEPS
from flatshard.optim.whole_optimizer import WholeParamOptimizer

__all__ = ["Muon"]


class Muon(WholeParamOptimizer):
    """``torch.optim.Muon`` (same arguments, defaults and math) for the 2-D parameters of a
    model sharded by ``fs.shard`` (or plain 2-D tensors). Parameters whose *full* shape is not
    2-D are refused: optimise embeddings, the output head and 1-D parameters with AdamW
    (``fs.optim.muon_split(model)`` splits a model that way)."""

    name = "fs.optim.Muon"

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = EPS,
        ns_steps: int = NS_STEPS,
        adjust_lr_fn: str | None = None,
    ) -> None:
        _check_hyper(lr, momentum, weight_decay, adjust_lr_fn)
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
        )  # fmt: skip
        super().__init__(params, defaults)
        self._setup_whole()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        try:
            for i, p in enumerate(self.param_groups[-1]["params"]):
                _check_matrix(p, len(self.param_groups) - 1, i)
        except ValueError:
            self.param_groups.pop()
            raise

    @torch.no_grad()
    def step(self, closure=None):
        """One Muon step on every parameter that has a gradient."""
        loss = self._run_closure(closure)
        run_jobs([self._job(p, group) for p, group in self._with_grads()], self._comm)
        return loss

    def _job(self, p: torch.Tensor, group: dict[str, Any]) -> Job:
        whole = self._whole_of(p)
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        return Job(whole, p.grad, state["momentum_buffer"], group)


def _check_hyper(lr: float, momentum: float, weight_decay: float, adjust: str | None) -> None:
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"lr is a tensor of {lr.numel()} elements; give a float or 1 element")
    for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
        if not value >= 0.0:
            raise ValueError(f"fs.optim.Muon: {name}={value}; it must be >= 0")
    if adjust not in ADJUST_LR_FNS:
        raise ValueError(
            f"fs.optim.Muon: adjust_lr_fn={adjust!r} is not supported; use None, 'original' "
            "or 'match_rms_adamw'"
        )


def _check_matrix(p: torch.Tensor, group_index: int, index: int) -> None:
    tag = fragment_tag(p)
    shape = tag.full_shape if tag is not None else p.shape
    if len(shape) != 2:
        kind = "fragment of a parameter" if tag is not None else "tensor"
        raise ValueError(
            f"fs.optim.Muon: param group {group_index}, parameter {index} is a {kind} of full "
            f"shape {tuple(shape)}; Muon orthogonalises 2-D matrices only. Optimise embeddings, "
            "the output head and every non-2-D parameter with AdamW (fs.optim.muon_split(model) "
            "returns (matrices, others))"
        )
