"""``fs.clip_grad_norm_``: the global gradient norm over every rank's shards.

[Note: why not torch.nn.utils.clip_grad_norm_]
torch's function computes the norm of the tensors it is given. On a sharded model those are
this rank's fragments, so it would clip each rank by its *local* norm: silently different on
every rank. (torch FSDP2 gets away with it because its gradients are DTensors that know they
are partial.) A flat layout has plain tensors, so flatshard cannot make torch's function
global; ``fs.clip_grad_norm_`` takes the same arguments (parameters or the model, max_norm,
norm_type, error_if_nonfinite, foreach), so porting is a change of module name, and the
README says so loudly.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from .comm.collectives import all_reduce
from .engine.state import get_state
from .params import state_of_parameters


@torch.no_grad()
def clip_grad_norm_(
    parameters: nn.Module | Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Scale every gradient so that the global ``norm_type``-norm is at most ``max_norm``.

    ``parameters``: the sharded model, or (as torch's) an iterable of its parameters (or one
    of them). Equals ``torch.nn.utils.clip_grad_norm_`` on the unsharded model: each element
    lives on exactly one rank of the shard group (padding holds no gradient), so the p-th
    powers add up over that group and the inf-norm is its maximum; replicas (no_shard,
    hybrid_shard) hold identical gradients and are not summed again. Returns the total norm
    (before clipping), the same on every rank. Every rank must call it.
    """
    params, state = _parameters_and_state(parameters)
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type={norm_type} must be positive (2.0, 1.0 or float('inf'))")
    grads = [p.grad for p in params if p.grad is not None and p.grad.numel()]
    device = state.device if state is not None else torch.device("cpu")
    local = torch.zeros((), dtype=torch.float32, device=device)
    if grads:
        norms = torch._foreach_norm(grads, norm_type) if foreach is not False else None
        if norms is None:
            norms = [torch.linalg.vector_norm(g, norm_type) for g in grads]
        stacked = torch.stack([n.to(torch.float32) for n in norms])
        local = stacked.max() if norm_type == float("inf") else stacked.pow(norm_type).sum()
    if state is None:  # no parameter at all (on every rank alike): nothing to clip
        return local
    inf = norm_type == float("inf")
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    # On the compute device whatever the gradients' (CPUOffload keeps them on the host, and
    # NCCL reduces device tensors only): every rank hands the collective the same kind.
    local = local.to(device)
    all_reduce(local, state.group, state.stats, op=op, name="norm_all_reduce")
    total = local if inf else local.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"fs.clip_grad_norm_: the total norm of order {norm_type} is {total.item()}; "
            "set error_if_nonfinite=False to clip anyway (gradients become NaN)"
        )
    clip_coef = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
    if grads:
        torch._foreach_mul_(grads, clip_coef.to(grads[0].device, grads[0].dtype))
    return total


def _parameters_and_state(parameters) -> tuple[list[torch.Tensor], object]:
    if isinstance(parameters, nn.Module):
        return list(parameters.parameters()), get_state(parameters)
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if not params:
        return [], None
    return params, state_of_parameters(params, "fs.clip_grad_norm_")
