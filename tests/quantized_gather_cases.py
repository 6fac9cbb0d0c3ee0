"""Cases of tests/test_quantized_gather.py, run on every rank of a Gloo pool (``dist_pool.py``).

``fs.Comm(gather="int8"|"fp8"|"bf16")``: the gathered full weights against the dequantized
shards of every rank (and the fp32 weights), the bytes ``fs.comm_stats`` counts, a few SGD
steps against the unquantized gather, forward vs backward weights, and the refusals.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import flatshard as fs
from flatshard.comm import quantize
from flatshard.core.state import get_state
from quantized_grads_cases import _local_batch  # the same global batch at any world


class Capture(torch.autograd.Function):
    """``x @ w.T`` that records the weight forward used and the one backward reads back
    (a saved view of the unit's ``full`` buffer, refilled by the regather)."""

    @staticmethod
    def forward(ctx, x, w, log):
        ctx.save_for_backward(x, w)
        ctx.log = log
        log.append(("forward", w.detach().clone()))
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        ctx.log.append(("backward", w.detach().clone()))
        return g @ w, g.t() @ x, None


class Probe(nn.Linear):
    def __init__(self, *args, log: list, **kwargs) -> None:
        super().__init__(*args, bias=False, **kwargs)
        self.log = log

    def forward(self, x):
        return Capture.apply(x, self.weight, self.log)


def tiny_model(log: list | None = None) -> nn.Module:
    torch.manual_seed(0)  # every rank the same weights
    log = [] if log is None else log
    # 40 * 40 = 1600 elements: several 256-element blocks per shard at world 2 and 3
    return nn.Sequential(nn.Linear(24, 40), nn.GELU(), Probe(40, 40, log=log), nn.Linear(40, 8))


def shard_tiny(gather: str | None, compute: torch.dtype | None, log: list | None = None):
    mp = None if compute is None else fs.MixedPrecision(param_dtype=compute)
    policy = fs.wrap.by_type(nn.Linear)
    comm = fs.Comm(gather=gather)
    # coalesce=False: three units, each resharded after forward and regathered for backward
    model = tiny_model(log)
    return fs.shard(model, policy=policy, mixed_precision=mp, comm=comm, coalesce=False)


def _every_rank(shard: torch.Tensor) -> torch.Tensor:
    rows = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, shard)
    return torch.stack(rows)


def gathered_full(fmt: str, compute: torch.dtype | None) -> dict:
    """Each unit gathered once: is ``full`` exactly the dequantized shards of every rank?
    Its error against the fp32 weights (over the bound), and the bytes counted."""
    model = shard_tiny(fmt, compute)
    state = get_state(model)
    fs.comm_stats(model, reset=True)
    exact, worst, expected_bytes = True, 0.0, 0
    for unit in state.units:
        state.ensure_gathered(unit)
        for g in unit.groups:
            masters = _every_rank(g.shard.detach())  # [world, S] fp32
            got = g.full.detach().view(g.world, g.shard_numel).float()
            if fmt == "bf16":
                want, bound = masters.to(torch.bfloat16), masters.abs() * 2.0**-8
                expected_bytes += 2 * g.shard_numel
            else:
                codes, scales = quantize.quantize(masters, fmt)
                want = quantize.dequantize(codes, scales).to(g.compute_dtype)
                bound = _bound(masters, scales, fmt, g.compute_dtype)
                expected_bytes += quantize.packed_row_bytes(g.shard_numel)
            exact = exact and torch.equal(got, want.float())
            ratio = (got - masters).abs() / (bound + 1e-30)
            worst = max(worst, ratio.nan_to_num(nan=float("inf")).max().item())  # NaN: fails
        unit.reshard(state.timeout)
    counted = fs.comm_stats(model).bytes["all_gather"]
    return {"exact": exact, "worst": worst, "bytes": counted, "expected": expected_bytes}


def _bound(x: torch.Tensor, scales: torch.Tensor, fmt: str, compute: torch.dtype) -> torch.Tensor:
    """Per element: half a code step (int8: absmax / 254) or e4m3's 2^-4 relative error,
    plus the rounding of the dequantized value to the compute dtype."""
    per_elem = scales.repeat_interleave(quantize.BLOCK, dim=1)[:, : x.shape[1]]
    if fmt == "int8":
        bound = per_elem * 0.5 * 1.0001
    else:
        bound = x.abs() * 2.0**-4 + per_elem * 2.0**-10
    if compute is torch.bfloat16:  # round to nearest bf16 of |value| <= |x| + bound
        bound = bound + (x.abs() + bound) * 2.0**-8
    return bound


def train(gather: str | None, steps: int = 4) -> dict:
    """bf16 compute, SGD: the global losses, and whether every backward read the bytes
    its forward used (the ``Probe`` layer's weight, which is regathered for backward)."""
    log: list = []
    model = shard_tiny(gather, torch.bfloat16, log)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, gathers = [], 0
    for step in range(steps):
        fs.comm_stats(model, reset=True)
        x, y = _local_batch(step)
        loss = (model(x).float() - y).square().mean()
        loss.backward()
        gathers = fs.comm_stats(model).calls["all_gather"]
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / dist.get_world_size())
    pairs = list(zip(log[0::2], log[1::2], strict=True))
    same = all(
        f[0] == "forward" and b[0] == "backward" and torch.equal(f[1], b[1]) for f, b in pairs
    )
    return {"losses": losses, "same": same and len(pairs) == steps, "gathers": gathers}


def full_state_is_the_masters() -> bool:
    """fp32 compute, int8 gather: ``fs.full_state_dict`` holds the exact weights, not the
    dequantized ones the forward computes with."""
    model = shard_tiny("int8", None)
    exported = fs.full_state_dict(model)  # rank 0's; the others get {}
    original = tiny_model().state_dict()
    if dist.get_rank() != 0:
        return exported == {}
    return exported.keys() == original.keys() and all(
        torch.equal(exported[k], v) for k, v in original.items()
    )


def summon_refused() -> str:
    model = shard_tiny("int8", None)
    try:
        with fs.summon_full_params(model):
            pass
    except NotImplementedError as err:
        return str(err)
    return ""


def disagree() -> str:
    """Rank 0 gathers in int8, the others unquantized: ``fs.shard`` must refuse."""
    try:
        shard_tiny("int8" if dist.get_rank() == 0 else None, None)
    except ValueError as err:
        return str(err)
    return ""
