"""``fs.clip_grad_norm_``: the global gradient norm over every rank's shards.

[Note: why not torch.nn.utils.clip_grad_norm_]
torch's function computes the norm of the tensors it is given. On a sharded model those are
this rank's fragments, so it would clip each rank by its *local* norm: silently different on
every rank. (torch FSDP2 gets away with it because its gradients are DTensors that know they
are partial.) A flat layout has plain tensors, so flatshard cannot make torch's function
global; ``fs.clip_grad_norm_`` takes the same arguments (parameters or the model, max_norm,
norm_type, error_if_nonfinite, foreach), so porting is a change of module name, and the
README says so loudly.

[Note: the norm over both axes]
With tensor parallelism (parallel/tensor.py) a parameter sharded over tp has a
different part on each tp rank, while a replicated one (a SequenceParallel norm) is the same
on all of them. Each rank sums the p-th powers of its gradients in two parts; both are summed
over the data-parallel ranks, the tp-sharded part over the tp ranks as well: every element
is counted once, as in the single-process norm.

[Note: the norm across stages]
A pipeline splits the model over the pp ranks: each rank's stages are sharded models of their
own (each over its dp mesh). ``fs.clip_grad_norm_(stages, max_norm, across=pp_group)`` sums
the p-th powers of each stage over its own ranks (as for one model), adds the stages of this
rank, then adds up over ``across``: each parameter of the whole model is counted once (ranks
of one pp group hold different stages), and every rank clips by the whole model's norm
(torchtitan all-reduces the norm over pp the same way). Copies of a weight declared with
``fs.tie_across_stages`` count once: every copy but the first is skipped (``is_tied_duplicate``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from flatshard.comm.collectives import all_reduce
from flatshard.core.params import fragment_tag, state_of_parameters
from flatshard.core.state import get_state
from flatshard.offload import to_compute
from flatshard.parallel.pipeline_tied import is_tied_duplicate


@torch.no_grad()
def clip_grad_norm_(
    parameters: nn.Module | Iterable[nn.Module] | Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    across: dist.ProcessGroup | DeviceMesh | None = None,
) -> torch.Tensor:
    """Scale every gradient so that the global ``norm_type``-norm is at most ``max_norm``.

    ``parameters``: the sharded model, or (as torch's) an iterable of its parameters (or one
    of them), or several sharded models (this rank's pipeline stages). Equals
    ``torch.nn.utils.clip_grad_norm_`` on the unsharded model: each element lives on exactly
    one rank of the shard group (padding holds no gradient), so the p-th powers add up over
    that group and the inf-norm is its maximum; replicas (no_shard, hybrid_shard) hold
    identical gradients and are not summed again. ``across``: a group (or 1-D mesh) whose
    ranks hold *other* parts of the model (the pipeline's pp group): the per-rank totals are
    added up over it too, so every stage clips by the norm of the whole model ([Note: the
    norm across stages]). Returns the total norm (before clipping), the same on every rank.
    Every rank must call it.
    """
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type={norm_type} must be positive (2.0, 1.0 or float('inf'))")
    parts = _parts(parameters)
    grads = [p.grad for params, _ in parts for p in params if _has_grad(p)]
    totals = [_model_powers(params, state, norm_type, foreach) for params, state in parts]
    total = _combine(totals, parts, norm_type, across)
    if error_if_nonfinite:
        check_finite(total, norm_type)
    clip_coef = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
    if grads:
        torch._foreach_mul_(grads, _coefficient_for(grads[0], clip_coef))
    return total


# [Note: host waits of clipping]
# On a device backend fs.clip_grad_norm_ never waits for the device: the norm is summed and
# all-reduced on the compute device and scales the gradients there (a tensor, never read).
# Two cases read it, as torch's clip_grad_norm_ does: ``error_if_nonfinite=True`` (the host
# must know whether to raise: ``check_finite``), and CPU offload, whose gradients live on the
# host and are scaled by the host (``norm_on_host``: the one copy back, after the norm's
# all-reduce). The tests count both apart (``flatshard.testing.host_sync.SEPARATE``).
def check_finite(total: torch.Tensor, norm_type: float) -> None:
    """``error_if_nonfinite=True``: raise if the norm is inf/NaN (a host read of it)."""
    if not torch.isfinite(total):
        raise RuntimeError(
            f"fs.clip_grad_norm_: the total norm of order {norm_type} is {total.item()}; "
            "set error_if_nonfinite=False to clip anyway (gradients become NaN)"
        )


def _coefficient_for(grad: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """The clip coefficient where ``grad`` lives, in its dtype."""
    if grad.device == coef.device:
        return coef.to(grad.dtype)
    return norm_on_host(coef, grad.device, grad.dtype)


def norm_on_host(coef: torch.Tensor, host: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """CPU offload: the coefficient copied to the host that scales the gradients (a wait for
    the device, as any host use of a device result)."""
    return coef.to(host, dtype)


def _has_grad(p: torch.Tensor) -> bool:
    return p.grad is not None and p.grad.numel() > 0


def _model_powers(params: list, state, norm_type: float, foreach) -> torch.Tensor:
    """One sharded model's sum of p-th powers (max for the inf-norm) over all its ranks."""
    with_grad = [p for p in params if _has_grad(p) and not is_tied_duplicate(p)]
    grads = [p.grad for p in with_grad]
    device = state.device if state is not None else torch.device("cpu")
    # fp32 at least (bf16 gradients' norms would round), fp64 for fp64 gradients
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    local = torch.zeros(2, dtype=dtype, device=device)
    if grads:  # [sharded over tp, the rest]: see [Note: the norm over both axes]
        local = _local_powers(
            grads, [_is_tp_sharded(p) for p in with_grad], norm_type, foreach, dtype
        )
    if state is None:  # no parameter at all (on every rank alike)
        return local.max() if norm_type == float("inf") else local.sum()
    op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
    # On the compute device whatever the gradients' (CPUOffload keeps them on the host, and
    # NCCL reduces device tensors only): every rank hands the collective the same kind.
    local = to_compute(local, device)
    all_reduce(local, state.group, state.stats, op=op, name="norm_all_reduce")
    if state.tp is not None:
        sharded = local[:1].clone()
        all_reduce(sharded, state.tp.group, state.stats, op=op, name="norm_all_reduce_tp")
        local = torch.cat([sharded, local[1:]])
    return local.max() if norm_type == float("inf") else local.sum()


def _combine(totals: list, parts: list, norm_type: float, across) -> torch.Tensor:
    """The models' totals as one norm (added up over ``across`` when given)."""
    inf = norm_type == float("inf")
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in totals) else torch.float32
    device = totals[0].device if totals else torch.device("cpu")
    stacked = torch.stack([t.to(device, dtype) for t in totals]) if totals else None
    local = torch.zeros((), dtype=dtype, device=device) if stacked is None else stacked
    local = local.max() if inf else local.sum()
    if across is not None:
        group = across.get_group() if hasattr(across, "get_group") else across
        stats = next((s.stats for _, s in parts if s is not None), None)
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        if stats is None:
            dist.all_reduce(local, op=op, group=group)
        else:
            all_reduce(local, group, stats, op=op, name="norm_all_reduce_across")
    return local if inf else local.pow(1.0 / norm_type)


def _local_powers(
    grads: list, tp_sharded: list[bool], norm_type: float, foreach, dtype: torch.dtype
) -> torch.Tensor:
    """[sum of |g|^p over tp-sharded gradients, over the others] (max for the inf-norm);
    the two parts are summed separately in Python lists, never by a device-side mask (no
    host-to-device copy)."""
    norms = torch._foreach_norm(grads, norm_type) if foreach is not False else None
    if norms is None:
        norms = [torch.linalg.vector_norm(g, norm_type) for g in grads]
    norms = [n.to(dtype) for n in norms]
    zero = torch.zeros((), dtype=dtype, device=norms[0].device)
    parts = [[n for n, s in zip(norms, tp_sharded, strict=True) if s == want] for want in (1, 0)]
    if norm_type == float("inf"):
        return torch.stack([torch.stack(p).max() if p else zero for p in parts])
    return torch.stack([torch.stack(p).pow(norm_type).sum() if p else zero for p in parts])


def _is_tp_sharded(param: torch.Tensor) -> bool:
    tag = fragment_tag(param)
    return tag is not None and tag.tp is not None and tag.tp.is_sharded


def _parts(parameters) -> list[tuple[list[torch.Tensor], object]]:
    """(parameters, their sharded state) per model the call covers."""
    if isinstance(parameters, nn.Module):
        return [(list(parameters.parameters()), get_state(parameters))]
    items = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if items and all(isinstance(m, nn.Module) for m in items):  # several models (stages)
        return [(list(m.parameters()), get_state(m)) for m in items]
    if not items:
        return [([], None)]
    return [(items, state_of_parameters(items, "fs.clip_grad_norm_"))]
