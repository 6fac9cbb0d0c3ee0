"""``AdamWKahan``: AdamW for bf16 parameters without an fp32 master copy.

Mixed precision usually keeps an fp32 master copy of every parameter because adding a small
update to a bf16 weight rounds it away (see ``rounding.py``). This optimizer keeps the
parameters in bf16 and makes the additions exact instead: each update is computed in fp32 (per
tensor, in chunks that bound the temporaries) and added with Kahan compensation (a bf16 buffer
per parameter) or stochastic rounding (no buffer). With bf16 moment estimates too, the optimizer
side costs 8 bytes per parameter (param, compensation, exp_avg, exp_avg_sq) instead of 14 for
a bf16 parameter with an fp32 master copy and fp32 moments (docs/mixed_precision.md).

Everything is elementwise, so it runs unchanged on flatshard's 1-D shard fragments.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from itertools import chain
from typing import Any

import torch

from flatshard.optim.rounding import kahan_add_, stochastic_round

ROUNDINGS = ("kahan", "stochastic", "nearest")
_CHUNK = 1 << 22  # elements per fp32 working chunk (~5 temporaries of 16 MiB each)
_LOW = (torch.bfloat16, torch.float16)


class AdamWKahan(torch.optim.Optimizer):
    """AdamW (``torch.optim.AdamW``'s update rule) whose additions to low-precision parameters
    do not lose small updates.

    Args:
        params, lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        rounding: how the fp32 update lands in a bf16/fp16 parameter: ``"kahan"`` (a
            compensation buffer in the parameter's dtype), ``"stochastic"`` (bf16 only, no
            buffer, exact in expectation) or ``"nearest"`` (plain rounding: small updates are
            lost — for comparison). fp32 parameters are always updated exactly as AdamW does.
        state_dtype: dtype of exp_avg/exp_avg_sq, ``"float32"`` or ``"bfloat16"``; default: the
            parameter's dtype (bf16 moments for bf16 parameters). bf16 moments are written back
            with stochastic rounding: with nearest rounding ``exp_avg_sq * 0.999`` rounds back to
            itself in bf16 and the second moment could never decay.
        seed: seeds stochastic rounding; the random bits of a step depend only on (seed, step,
            parameter index, chunk), so a resumed run draws what the uninterrupted one would.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        rounding: str = "kahan",
        state_dtype: str | torch.dtype | None = None,
        seed: int = 0,
    ) -> None:
        _check_hyper(lr, betas, eps, weight_decay)
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding={rounding!r}; choose one of {', '.join(ROUNDINGS)}")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "rounding": rounding,
            "state_dtype": _dtype_name(state_dtype),  # a str: checkpoints store JSON hyper
        }
        super().__init__(params, defaults)
        self.seed = int(seed)
        for group in self.param_groups:
            for p in group["params"]:
                if group["rounding"] == "stochastic" and p.dtype == torch.float16:
                    raise ValueError(
                        "rounding='stochastic' supports bf16 (and fp32) parameters, got fp16; "
                        "use rounding='kahan' for fp16"
                    )

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0  # position among all parameters: part of the stochastic-rounding seed
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise TypeError("AdamWKahan does not support sparse gradients")
                    self._update(p, group, index)
                index += 1
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but keeps each state tensor's saved dtype: torch casts floating state to
        the parameter's dtype, which would round fp32 moments of bf16 parameters to bf16."""
        super().load_state_dict(state_dict)  # validates the groups; deep-copies its input
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        by_param = {p: state_dict["state"].get(i) for i, p in zip(saved_ids, params, strict=True)}
        for p, saved in by_param.items():
            for key, value in (saved or {}).items():
                if key != "step" and isinstance(value, torch.Tensor):
                    self.state[p][key] = value.to(device=p.device, dtype=value.dtype, copy=True)

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        moments = _state_dtype(p, group)
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros(p.shape, dtype=moments, device=p.device)
        state["exp_avg_sq"] = torch.zeros(p.shape, dtype=moments, device=p.device)
        if group["rounding"] == "kahan" and p.dtype in _LOW:
            state["compensation"] = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
        return state

    def _update(self, p: torch.Tensor, group: dict[str, Any], index: int) -> None:
        state = self.state[p] or self._init_state(p, group)
        state["step"] += 1
        step = int(state["step"].item())
        beta1, beta2 = group["betas"]
        lr, wd = group["lr"], group["weight_decay"]
        step_size = lr / (1 - beta1**step)
        root_bc2 = math.sqrt(1 - beta2**step)
        names = ("exp_avg", "exp_avg_sq", "compensation")
        tensors = [p, p.grad, *(state[n] for n in names if n in state)]
        for chunk, parts in enumerate(_chunks(tensors)):
            q, g, m_low, v_low, *comp = parts
            rng = self._generator(q.device, step, index, chunk)
            g = g.float()
            # .float() of an fp32 state is the state itself: updated in place, read-only below
            m = m_low.float().lerp_(g, 1 - beta1)
            v = v_low.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
            _store(m_low, m, rng)
            _store(v_low, v, rng)
            denom = v.sqrt().div_(root_bc2).add_(group["eps"])
            update = m.div(denom).mul_(-step_size)
            if wd:
                update.add_(q.float(), alpha=-lr * wd)  # decoupled decay, from the old value
            _apply(q, update, comp[0] if comp else None, group["rounding"], rng)

    def _generator(
        self, device: torch.device, step: int, index: int, chunk: int
    ) -> torch.Generator:
        generator = torch.Generator(device=device)
        generator.manual_seed(hash((self.seed, step, index, chunk)) & ((1 << 63) - 1))
        return generator


def _apply(
    q: torch.Tensor,
    update: torch.Tensor,
    comp: torch.Tensor | None,
    rounding: str,
    rng: torch.Generator,
) -> None:
    if q.dtype not in _LOW:
        q.add_(update)  # fp32 parameter: exact AdamW
    elif comp is not None:
        kahan_add_(q, comp, update)
    elif rounding == "stochastic":
        q.copy_(stochastic_round(update.add_(q.float()), rng))
    else:
        q.add_(update)  # nearest: computed in fp32, rounded once


def _store(low: torch.Tensor, value: torch.Tensor, rng: torch.Generator) -> None:
    if low.dtype == torch.bfloat16:
        low.copy_(stochastic_round(value, rng))
    elif low.data_ptr() != value.data_ptr():
        low.copy_(value)


def _chunks(tensors: list[torch.Tensor]) -> Iterable[list[torch.Tensor]]:
    """Matching flat chunks of same-shaped tensors (whole tensors when one is not contiguous)."""
    if not all(t.is_contiguous() for t in tensors):
        yield tensors
        return
    flat = [t.view(-1) for t in tensors]
    yield from (list(parts) for parts in zip(*(f.split(_CHUNK) for f in flat), strict=True))


def _state_dtype(p: torch.Tensor, group: dict[str, Any]) -> torch.dtype:
    name = group["state_dtype"]
    if name is None:
        return p.dtype if p.dtype == torch.bfloat16 else torch.float32
    return getattr(torch, name)


def _dtype_name(dtype: str | torch.dtype | None) -> str | None:
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"state_dtype={dtype!r}; use None, 'float32' or 'bfloat16'")
    return name


def _check_hyper(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    if not lr >= 0:
        raise ValueError(f"lr={lr} must be >= 0")
    if not (len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"betas={betas} must be two values in [0, 1)")
    if not eps >= 0:
        raise ValueError(f"eps={eps} must be >= 0")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay={weight_decay} must be >= 0")
