"""``fs.optim.Adafactor``: ``torch.optim.Adafactor`` on a sharded model's fragments.

Adafactor needs three facts about each whole parameter: its RMS (the step size), the row and
column means of its squared gradient (the factored second moment), and the RMS of its update
(the clipping). All three are sums over the parameter, so each rank sums its fragment and two
small all-reduces per step (over the shard group, every parameter at once) finish them:
``1 + B (m + n)`` numbers per matrix, then one per parameter. Nothing is gathered. The row and
column factors are kept whole and identical on every rank (torch's shapes and key names, so
checkpoints store them as ordinary replicated tensors); 1-D parameters keep a fragment-shaped
``variance``. The update is computed twice (once for its norm, once to apply it) rather than
kept for every parameter: the extra memory is one fragment at a time.

With tensor parallelism the sums are the global matrix's: each rank's are placed at its
TP-local block's global rows and columns (``tp_stats.py``) and the all-reduces run over dp,
then over the tp peers; the factors are the global ones, the same on every rank.

[Note: no host reads in the step]
torch's Adafactor reads two numbers per parameter on the host (``param.norm().item()`` for
the step size, ``update.norm().item()`` for the clipping): each one waits for the device. Here
both stay 0-dim tensors on the gradients' device (the step size ``max(eps2, RMS) * rho`` and
the clip ``max(1, RMS(update) / d)`` in float64, as torch's Python floats), so a step on a
device backend never waits for the device; only the step count (a host tensor, as torch
keeps it) is read. Under CPU offload the state lives on the host, so the two reduced vectors
come back to it (``offload_sums_on_host``: the host waits there, as for the offloaded
gradients themselves).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from flatshard.offload import to_compute
from flatshard.optim.exchange import all_reduce_sum
from flatshard.optim.factored import Rows, factored_variance, partial_sums, update_factors
from flatshard.optim.tp_stats import block_factors, to_global
from flatshard.optim.whole import WholeParam
from flatshard.optim.whole_optimizer import WholeParamOptimizer

__all__ = ["Adafactor"]


class Adafactor(WholeParamOptimizer):
    """``torch.optim.Adafactor`` (same arguments, defaults and math) for a model sharded by
    ``fs.shard`` (or plain tensors). ``foreach`` is accepted for compatibility; the sharded
    step has one implementation."""

    name = "fs.optim.Adafactor"

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-2,
        beta2_decay: float = -0.8,
        eps: tuple[float | None, float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
    ) -> None:
        _check_hyper(lr, beta2_decay, eps, d, weight_decay)
        if foreach:
            warnings.warn("fs.optim.Adafactor: foreach=True has no effect", stacklevel=2)
        defaults = dict(
            lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay,
            foreach=foreach, maximize=maximize,
        )  # fmt: skip
        super().__init__(params, defaults)
        self._setup_whole()

    @torch.no_grad()
    def step(self, closure=None):
        """One Adafactor step on every parameter that has a gradient."""
        loss = self._run_closure(closure)
        items = [self._item(p, g) for p, g in self._with_grads()]
        if not items:
            return loss
        device, host = items[0].whole.device, items[0].grad.device
        # The collectives run on the compute device (NCCL reduces device tensors only, and
        # under CPUOffload the gradients live on the host); the state stays where it lives.
        # Nothing is read on the host: the step sizes and clipping factors stay tensors
        # (see [Note: no host reads in the step]).
        sums = to_compute(torch.cat([item.local_sums() for item in items]), device)
        self._reduce(sums, items[0].whole)
        sums = offload_sums_on_host(sums, host)
        offset, norms = 0, []
        for item in items:
            offset = item.advance(sums, offset)
            norms.append(item.update_square_sum())
        norms_t = to_compute(torch.stack(norms), device)
        self._reduce(norms_t, items[0].whole)
        norms_t = offload_sums_on_host(norms_t, host)
        for i, item in enumerate(items):
            item.apply(norms_t[i])
        return loss

    def _reduce(self, sums: torch.Tensor, whole: WholeParam) -> None:
        """Sum over the shard group, then (with TP) over the tp peers."""
        all_reduce_sum(sums, whole.group, self._comm)
        all_reduce_sum(sums, whole.tp_group, self._comm)

    def _item(self, p: torch.Tensor, group: dict[str, Any]) -> _Item:
        whole = self._whole_of(p)
        state = self.state[p]
        if not state:
            _init_state(state, whole, p.grad)
        grad = -p.grad if group["maximize"] else p.grad
        return _Item(whole, grad.reshape(-1), state, group)


def _init_state(state: dict, whole: WholeParam, grad: torch.Tensor) -> None:
    """torch's state: ``step``, and ``row_var``/``col_var`` in the *full* shape's factor shapes
    (whole on every rank) for a matrix, or a fragment-shaped ``variance`` for a vector."""
    state["step"] = torch.tensor(0.0, dtype=torch.get_default_dtype())
    shape = whole.global_shape  # torch's factors of the global matrix, whole on every rank
    if len(shape) > 1:
        state["row_var"] = grad.new_zeros((*shape[:-1], 1))
        state["col_var"] = grad.new_zeros((*shape[:-2], 1, shape[-1]))
    else:
        state["variance"] = torch.zeros_like(grad, memory_format=torch.preserve_format)


@dataclass
class _Item:
    """One parameter's Adafactor step on this rank."""

    whole: WholeParam
    grad: torch.Tensor  # flat fragment, sign already flipped for ``maximize``
    state: dict
    hyper: dict[str, Any]
    alpha: torch.Tensor | None = None  # the step size (a 0-dim tensor where grad lives)
    eps1: float = 0.0

    @property
    def factored(self) -> bool:
        return "row_var" in self.state

    @property
    def rows(self) -> Rows:
        return Rows.of(self.whole.shape, self.whole.start, self.whole.end)

    def local_sums(self) -> torch.Tensor:
        """This fragment's sum of squares of the parameter, then (matrices) its part of the
        global matrix's row and column sums of the squared gradient; zeros on the tp peers
        that hold a replicated parameter again (``counts_once``)."""
        p = self.whole.param.reshape(-1)
        sums = _wide(p).square().sum().reshape(1).to(self.grad.dtype)
        if self.factored:
            rows = self.rows
            block = torch.cat([sums, partial_sums(self.grad * self.grad, rows)])
            sums = to_global(block, self.whole, rows.batches * rows.m)
        return sums if self.whole.counts_once else torch.zeros_like(sums)

    def advance(self, sums: torch.Tensor, offset: int) -> int:
        """The step count, the step size and the second moment, from the reduced sums at
        ``offset``; returns the offset of the next parameter's sums."""
        h, step_t = self.hyper, self.state["step"]
        step_t += 1
        step = step_t.item()  # a host tensor, as torch keeps it: no sync
        weight = step ** h["beta2_decay"]  # 1 - beta2_t
        lr = float(h["lr"])
        rho = min(lr, 1 / step**0.5)
        # max(eps2, RMS(param)) * rho, as torch's in float64 (its Python floats), on the device
        rms = sums[offset].double().clamp(min=0.0).sqrt() / self.whole.global_numel**0.5
        self.alpha = rms.clamp(min=h["eps"][1]) * rho
        eps1 = h["eps"][0]
        self.eps1 = torch.finfo(self.whole.param.dtype).eps if eps1 is None else eps1
        if not self.factored:
            self.state["variance"].lerp_(self.grad * self.grad, weight)
            return offset + 1
        rows = Rows.of(self.whole.global_shape, 0, 0)  # the global matrix's counts
        size = rows.batches * (rows.m + rows.n)
        factors = sums[offset + 1 : offset + 1 + size]
        update_factors(self.state["row_var"], self.state["col_var"], factors, rows, weight)
        return offset + 1 + size

    def update(self) -> torch.Tensor:
        """This fragment's ``grad / sqrt(max(V, eps1^2))`` (flat)."""
        if self.factored:
            s = self.state
            row, col, mean = block_factors(s["row_var"], s["col_var"], self.whole, self.eps1)
            var = factored_variance(row, col, mean, self.rows, self.grad.numel())
        else:
            var = self.state["variance"].reshape(-1).clone()
        return var.clamp_(min=self.eps1 * self.eps1).rsqrt_().mul_(self.grad)

    def update_square_sum(self) -> torch.Tensor:
        if not self.whole.counts_once:  # a replicated parameter's counts on tp rank 0
            return self.grad.new_zeros(())
        return _wide(self.update()).square().sum().to(self.grad.dtype)

    def apply(self, update_sq: torch.Tensor) -> None:
        """Decoupled weight decay, then the update clipped to RMS ``d`` (``update_sq``: the
        reduced sum of its squares, a 0-dim tensor: never read on the host)."""
        p, h = self.whole.param, self.hyper
        if h["weight_decay"] != 0:
            p.mul_(1 - float(h["lr"]) * h["weight_decay"])
        rms = update_sq.double().clamp(min=0.0).sqrt() / (self.whole.global_numel**0.5 * h["d"])
        step = -self.alpha / rms.clamp(min=1.0)
        p.add_(self.update().view(p.shape).mul_(step.to(p.dtype)))


def offload_sums_on_host(tensor: torch.Tensor, host: torch.device) -> torch.Tensor:
    """Reduced statistics where the gradients live. Under CPU offload that is the host, which
    steps the state there: the optimizer's one wait for the device, as any host use of a
    device result (counted apart by the tests' ``HostSyncs``); otherwise ``tensor`` itself."""
    return tensor if tensor.device == host else tensor.to(host)


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in at least fp32 for a sum of squares (bf16 would lose it; a float64 model
    keeps its own precision)."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def _check_hyper(lr, beta2_decay: float, eps: tuple, d: float, weight_decay: float) -> None:
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"lr is a tensor of {lr.numel()} elements; give a float or 1 element")
    checks = [
        ("lr", lr, lr >= 0.0, ">= 0"),
        ("beta2_decay", beta2_decay, beta2_decay <= 0.0, "<= 0"),
        ("eps[0]", eps[0], eps[0] is None or eps[0] >= 0.0, "None or >= 0"),
        ("eps[1]", eps[1], eps[1] >= 0.0, ">= 0"),
        ("d", d, d >= 1.0, ">= 1"),
        ("weight_decay", weight_decay, weight_decay >= 0.0, ">= 0"),
    ]
    for name, value, ok, rule in checks:
        if not ok:
            raise ValueError(f"fs.optim.Adafactor: {name}={value}; it must be {rule}")
