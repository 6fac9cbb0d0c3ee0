"""Cases of tests/test_quantized_grads.py, run on every rank of a Gloo pool (``dist_pool.py``).

``fs.Comm(reduce="int8"|"fp8", error_feedback=...)``: the quantized all-to-all against an fp64
sum of the dequantized chunks, one step's sharded gradients and bytes against the fp32
reduce-scatter's, gradients accumulated over steps (with and without error feedback), and a
checkpoint saved at one world size and resumed at another.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch import nn

import flatshard as fs
from flatshard.checkpoint import residuals
from flatshard.checkpoint.contents import model_layout
from flatshard.comm import quantize
from flatshard.comm.collectives import CommStats, quantized_all_to_all_sum
from flatshard.core.state import get_state
from parity_models import mesh_for

GLOBAL_BATCH = 12  # divisible by 2 and 3: the same global batch at either world size


def tiny_model() -> nn.Module:
    torch.manual_seed(0)  # every rank the same weights
    return nn.Sequential(
        nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 40), nn.GELU(), nn.Linear(40, 8)
    )


def shard_tiny(reduce: str | None, feedback: bool = False, strategy="full_shard") -> nn.Module:
    comm = fs.Comm(reduce=reduce, error_feedback=feedback)
    policy, mesh = fs.wrap.by_type(nn.Linear), mesh_for(strategy)
    return fs.shard(tiny_model(), policy=policy, strategy=strategy, mesh=mesh, comm=comm)


def _local_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of global batch ``step`` (the same global batch at any world)."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(GLOBAL_BATCH, 24, generator=g), torch.randn(GLOBAL_BATCH, 8, generator=g)
    per = GLOBAL_BATCH // dist.get_world_size()
    mine = slice(dist.get_rank() * per, (dist.get_rank() + 1) * per)
    return x[mine], y[mine]


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    x, y = _local_batch(step)
    return (model(x) - y).square().mean() * 100.0  # * 100: gradients well above fp8's floor


def _grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


# ---- the collective alone ------------------------------------------------------------------------
def collective_sum(fmt: str, row: int = 300) -> dict:
    """Every rank's random ``[world, row]`` gradient through ``quantized_all_to_all_sum``:
    the largest difference from the fp64 sum of every rank's dequantized chunk ``rank``."""
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    full = torch.randn(world, row, generator=g) * torch.logspace(-4, 1, row)
    sent = torch.empty(world, quantize.packed_row_bytes(row), dtype=torch.uint8)
    received = torch.empty_like(sent)
    quantize.pack(*quantize.quantize(full, fmt), sent)
    out, stats = torch.empty(row), CommStats()
    work = quantized_all_to_all_sum(out, sent, received, fmt, dist.group.WORLD, stats)
    work.wait(datetime.timedelta(seconds=60))
    everyone = [torch.empty_like(full) for _ in range(world)]
    dist.all_gather(everyone, full)
    expected = sum(quantize.dequantize(*quantize.quantize(f, fmt))[rank].double() for f in everyone)
    exact = sum(f[rank].double() for f in everyone)
    return {
        "err": (out.double() - expected).abs().max().item() / expected.abs().max().item(),
        "lossy": (out.double() - exact).abs().max().item() / exact.abs().max().item(),
        "bytes": stats.bytes["all_to_all"],
        "expected_bytes": world * (row + 4 * quantize.blocks_per_row(row)),
    }


# ---- one step ------------------------------------------------------------------------------------
def one_step(reduce: str | None, feedback: bool = False, strategy: str = "full_shard") -> dict:
    model = shard_tiny(reduce, feedback, strategy)
    fs.comm_stats(model, reset=True)
    _loss(model, 0).backward()
    rows = [g.shard_numel for u in get_state(model).units for g in u.groups if g.requires_grad]
    return {"grad": _grads(model).clone(), "bytes": dict(fs.comm_stats(model).bytes), "rows": rows}


def step_parity(fmt: str, feedback: bool, strategy: str = "full_shard") -> dict:
    """One step's sharded gradients against the fp32 reduce-scatter's (relative to its
    largest element), and the bytes each setting counted."""
    ref, run = one_step(None, False, strategy), one_step(fmt, feedback, strategy)
    err = (run["grad"] - ref["grad"]).abs().max().item() / ref["grad"].abs().max().item()
    world = dist.get_world_size() if strategy != "hybrid_shard" else 2  # the shard group
    expected = sum(world * quantize.packed_row_bytes(row) for row in run["rows"])
    return {"err": err, "bytes": run["bytes"], "fp32_bytes": ref["bytes"], "expected": expected}


# ---- steps: error feedback -----------------------------------------------------------------------
def accumulated(fmt: str | None, feedback: bool, steps: int = 16) -> torch.Tensor:
    """The sum over ``steps`` backwards of the same batch's sharded gradient (no optimizer:
    the parameters stay, so the exact sum is ``steps`` times one gradient)."""
    model = shard_tiny(fmt, feedback)
    total = None
    for _ in range(steps):
        _loss(model, 0).backward()
        grads = _grads(model).clone()
        total = grads if total is None else total + grads
        model.zero_grad(set_to_none=True)
    return total


def feedback_tracks(fmt: str, steps: int = 16) -> dict:
    """Relative error of the accumulated quantized gradient vs the fp32 one, with and
    without error feedback."""
    exact = accumulated(None, False, steps)
    scale = exact.abs().max().item()
    plain = (accumulated(fmt, False, steps) - exact).abs().max().item() / scale
    fed = (accumulated(fmt, True, steps) - exact).abs().max().item() / scale
    return {"plain": plain, "feedback": fed}


# ---- checkpoints ---------------------------------------------------------------------------------
def _train(model: nn.Module, opt, steps: range) -> list[float]:
    """Losses of the global batch (every rank the same list)."""
    losses = []
    for step in steps:
        loss = _loss(model, step)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / dist.get_world_size())
    return losses


def mean_residuals(model: nn.Module) -> dict[str, torch.Tensor]:
    """The owed correction ``M`` per parameter, whole (gathered from every rank's pieces)."""
    layout = model_layout(model)
    shards = residuals.mean_shards(model, layout.name_of)
    mine = [(name, layout.params[name].start, piece.tolist()) for name, piece in shards.items()]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    full = {n: torch.zeros(p.numel) for n, p in layout.params.items()}
    for pieces in everyone:
        for name, start, values in pieces:
            full[name][start : start + len(values)] = torch.tensor(values)
    return full


def direct_mean_residuals(model: nn.Module) -> dict[str, torch.Tensor]:
    """``M`` computed here, independently of the checkpoint code: every rank's whole residual
    summed over all ranks, divided by the world, cut at each parameter's flat offset."""
    names, out = model_layout(model).name_of, {}
    residuals = get_state(model).stats.residuals
    for unit in get_state(model).units:
        for group in (g for g in unit.groups if g.requires_grad):
            total = residuals.of(group).clone()
            dist.all_reduce(total)
            total /= dist.get_world_size()
            for spec in group.specs:
                out[names[id(spec.fragment)]] = total[spec.offset : spec.offset + spec.numel]
    return out


def _model_and_opt(fmt: str, feedback: bool, strategy: str = "full_shard"):
    model = shard_tiny(fmt, feedback, strategy)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def save_run(path: str, fmt: str, first: int, then: int, strategy: str = "full_shard") -> dict:
    """Train ``first`` steps, save, keep training ``then`` steps (the uninterrupted curve)."""
    model, opt = _model_and_opt(fmt, True, strategy)
    _train(model, opt, range(first))
    residual = direct_mean_residuals(model)
    fs.save(path, model=model, optimizer=opt)
    return {"losses": _train(model, opt, range(first, first + then)), "residual": residual}


def resume_run(path: str, fmt: str, first: int, then: int, feedback: bool = True) -> dict:
    """Load (at this world size) and train ``then`` steps from step ``first``."""
    model, opt = _model_and_opt(fmt, feedback)
    fs.load(path, model=model, optimizer=opt)
    residual = mean_residuals(model) if feedback else {}
    return {"losses": _train(model, opt, range(first, first + then)), "residual": residual}


def disagree() -> str:
    """Rank 0 asks for error feedback, the others do not: ``fs.shard`` must refuse."""
    try:
        shard_tiny("int8", dist.get_rank() == 0)
    except ValueError as err:
        return str(err)
    return ""
