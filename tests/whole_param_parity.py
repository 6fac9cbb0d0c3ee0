"""The parity harness of the whole-parameter optimizers (fs.optim.Muon, fs.optim.Adafactor).

``optimizer_parity`` trains a sharded copy of a ``parity_models`` case on each rank's slice of
every global batch with a flatshard optimizer, and a plain copy on the whole batch with torch's
own, and reports rank 0's parameter and optimizer-state errors (full shapes) and every rank's
gradient error at every step.

``handoff=True`` gives the reference, after its gradient was compared, the sharded model's
reduced gradient bit for bit. Muon needs it: torch's Newton–Schulz runs in bf16, so two
unsharded torch runs whose gradients differ by rounding (the same batch summed in two halves)
already differ by ~5e-5 after 4 steps at lr=1e-3 (docs/optimizers.md); with the
same gradient bits the sharded step must equal torch's to fp32 rounding.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import flatshard as fs
from parity_models import CASES, mesh_for, rel_err

Factory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def full_tensor(run: Run, fragment: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The whole parameter-shaped tensor whose fragments (one per shard rank) are the
    ``fragment``-shaped tensors on each rank (gradients, state); every rank gets it."""
    info = _info_of(run.model)[id(like)]
    full = torch.zeros(info.full_shape.numel(), dtype=fragment.dtype)
    start, end = info.flat_range
    full[start:end] = fragment.detach().reshape(-1)
    if run.shard_group is not None:  # disjoint ranges, zeros elsewhere: the sum is exact
        dist.all_reduce(full, group=run.shard_group)
    return full.view(info.full_shape)


def shard_group(strategy: str, mesh) -> dist.ProcessGroup | None:
    """The ranks ``strategy`` splits each parameter over (``mesh``: what ``fs.shard`` got):
    none for no_shard, the mesh's "shard" dimension for hybrid_shard, every rank otherwise."""
    if strategy == "no_shard":
        return None
    return mesh["shard"].get_group() if mesh is not None else dist.group.WORLD


def _info_of(model: nn.Module) -> dict:
    return {id(i.fragment): i for i in fs.fragment_info(model).values()}


@dataclass
class Run:
    """A sharded copy and a plain copy of a ``parity_models`` case, and their optimizers over
    the parameters whose full shape ``select`` picks (``pairs``: fragment, plain parameter)."""

    name: str
    model: nn.Module
    ref: nn.Module
    pairs: list[tuple[nn.Parameter, nn.Parameter]]
    opt: torch.optim.Optimizer
    ref_opt: torch.optim.Optimizer
    shard_group: dist.ProcessGroup | None  # see ``shard_group``
    grad_err: float = 0.0


def build_run(name: str, strategy: str, make: Factory, make_ref: Factory, select: Callable) -> Run:
    case = CASES[name]
    torch.manual_seed(0)
    ref = case.build()
    model = copy.deepcopy(ref)
    mesh = mesh_for(strategy)
    fs.shard(model, policy=case.policy(), strategy=strategy, mesh=mesh)
    plain = dict(ref.named_parameters())
    pairs = [
        (p, plain[n])
        for n, p in model.named_parameters()
        if p.requires_grad and select(fs.full_shape(p))
    ]
    opts = make([p for p, _ in pairs]), make_ref([r for _, r in pairs])
    return Run(name, model, ref, pairs, *opts, shard_group(strategy, mesh))


def train(run: Run, steps: range, handoff: bool, rows: int | None = None) -> None:
    """Steps ``steps`` (their indices seed the global batches of ``rows`` rows, default
    2 per rank) of both copies; the worst gradient error goes to ``run.grad_err``."""
    case = CASES[run.name]
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        batch = case.batch(torch.Generator().manual_seed(step), rows or 2 * world)
        case.loss(run.model, batch.chunk(world)[rank]).backward()
        case.loss(run.ref, batch).backward()
        for p, r in run.pairs:
            if p.grad is None:
                assert r.grad is None, "None-ness differs"
                continue
            full = full_tensor(run, p.grad, p)
            run.grad_err = max(run.grad_err, rel_err(full, r.grad))
            if handoff:
                r.grad.copy_(full)
        run.opt.step(), run.ref_opt.step()
        run.model.zero_grad(), run.ref.zero_grad()


def report(run: Run) -> dict:
    """grad_err (this rank, worst over steps), sd_err and state_err (rank 0; 0.0 elsewhere),
    and ``empty``: how many selected fragments are empty on this rank."""
    return dict(
        grad_err=run.grad_err,
        sd_err=_params_err(run.model, run.ref),
        state_err=_state_err(run),
        empty=sum(1 for p, _ in run.pairs if p.numel() == 0),
    )


def optimizer_parity(
    name: str,
    strategy: str,
    make: Factory,
    make_ref: Factory,
    *,
    select: Callable[[torch.Size], bool],
    steps: int = 4,
    handoff: bool = False,
) -> dict:
    """``report`` after ``steps`` steps of a fresh run."""
    run = build_run(name, strategy, make, make_ref, select)
    train(run, range(steps), handoff)
    return report(run)


def _params_err(model: nn.Module, ref: nn.Module) -> float:
    full = fs.full_state_dict(model)
    return (
        max((rel_err(full[k], v) for k, v in ref.state_dict().items()), default=0.0)
        if full
        else 0.0
    )


def _state_err(run: Run) -> float:
    """Worst relative error of every optimizer state tensor, compared in full shape (every
    rank takes part in the gathers; rank 0 reports)."""
    worst = 0.0
    for p, r in run.pairs:
        mine, theirs = run.opt.state.get(p, {}), run.ref_opt.state.get(r, {})
        assert set(mine) == set(theirs), (sorted(mine), sorted(theirs))
        for key, value in theirs.items():
            ours = mine[key]
            if torch.is_tensor(ours) and ours.shape == p.shape and value.dim() > 0:
                ours = full_tensor(run, ours, p)  # fragment-shaped: gather it
            worst = max(
                worst, rel_err(torch.as_tensor(ours).float(), torch.as_tensor(value).float())
            )
    return worst if dist.get_rank() == 0 else 0.0
