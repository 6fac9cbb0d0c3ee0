"""``fs.clip_grad_norm_``: the global gradient norm over every rank's shards."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .api import get_state
from .collectives import all_reduce


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every gradient so that the global ``norm_type``-norm is at most ``max_norm``.

    Equals ``torch.nn.utils.clip_grad_norm_`` on the unsharded model: each element lives on
    exactly one rank of the shard group (padding holds no gradient), so the p-th powers add up
    over that group and the inf-norm is its maximum; replicas (no_shard, hybrid_shard) hold
    identical gradients and are not summed again. Returns the total norm (before clipping).
    """
    state = get_state(model)
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type={norm_type} must be positive (2.0, 1.0 or float('inf'))")
    grads = [p.grad for p in model.parameters() if p.grad is not None and p.grad.numel()]
    local = torch.zeros((), dtype=torch.float32, device=state.device)
    if grads:
        norms = torch._foreach_norm(grads, norm_type)
        stacked = torch.stack([n.to(torch.float32) for n in norms])
        local = stacked.max() if norm_type == float("inf") else stacked.pow(norm_type).sum()
    if norm_type == float("inf"):
        all_reduce(local, state.group, state.stats, op=dist.ReduceOp.MAX, name="norm_all_reduce")
        total = local
    else:
        all_reduce(local, state.group, state.stats, name="norm_all_reduce")
        total = local.pow(1.0 / norm_type)
    clip_coef = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
    if grads:
        torch._foreach_mul_(grads, clip_coef.to(grads[0].dtype))
    return total
