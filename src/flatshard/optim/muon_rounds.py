"""The rounds of a distributed Muon step: gather to owners, orthogonalise, scatter back.

Round k: every rank sends its fragment of each owner's k-th matrix to that owner (one
all-to-all, bf16), each owner orthogonalises its matrix, and a second all-to-all sends every
rank its fragment of each update. The next round's gather is started before this round's
Newton–Schulz and the scatter is waited on a round later, so communication overlaps compute;
per rank at most four owned matrices are alive at a time (received k and k+1, the update k
and k-1 in flight), whatever the model's size. The collectives depend only on the shapes and
on which parameters have a gradient, so every rank issues the same ones in the same order.

With tensor parallelism (see [Note: whole-parameter optimizers]) an owner receives its
matrix's TP-local block; ``Job.orthogonalize`` all-gathers the blocks over the tp peers (who
own the same job in the same round), orthogonalises the global matrix and returns this rank's
block of the update. Each tp peer repeats its column's owner's Newton–Schulz work (tp times
the arithmetic of the model without TP); spreading the matrices over the tp peers as well
would take one more exchange per round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flatshard.comm.collectives import PendingWork
from flatshard.optim.exchange import all_to_all, gather_over_tp
from flatshard.optim.newton_schulz import adjusted_lr, ns_cost, orthogonalize
from flatshard.optim.whole import Comm, WholeParam, assign_owners, rounds_of
from flatshard.parallel.tensor import local_part

WIRE = torch.bfloat16  # torch's Newton–Schulz starts with grad.bfloat16(): lossless to send


@dataclass
class Job:
    """One parameter's Muon step on this rank."""

    whole: WholeParam
    grad: torch.Tensor
    buf: torch.Tensor  # the momentum buffer, fragment-shaped
    hyper: dict[str, Any]  # its param group

    def momentum_update(self) -> torch.Tensor:
        """Advance the momentum (elementwise, on the fragment); the fragment of the matrix to
        orthogonalise."""
        momentum = self.hyper["momentum"]
        self.buf.lerp_(self.grad, 1 - momentum)
        return self.grad.lerp(self.buf, momentum) if self.hyper["nesterov"] else self.buf

    def orthogonalize(self, flat: torch.Tensor, comm: Comm) -> torch.Tensor:
        """The orthogonalised update of the matrix whose (TP-local) block is ``flat``, this
        block of it. With TP every tp peer must call it for the same job (it gathers)."""
        h, whole = self.hyper, self.whole
        matrix = flat.view(whole.shape)
        if whole.tp is not None:
            matrix = gather_over_tp(matrix, whole.tp, whole.tp_group, comm)
        update = orthogonalize(matrix, h["ns_coefficients"], h["ns_steps"], h["eps"])
        return local_part(update, whole.tp)

    def apply(self, update: torch.Tensor) -> None:
        """Decoupled weight decay, then the orthogonalised update (this rank's part of it)."""
        p, h = self.whole.param, self.hyper
        lr = float(h["lr"])
        p.mul_(1 - lr * h["weight_decay"])
        lr_here = adjusted_lr(lr, h["adjust_lr_fn"], self.whole.global_shape)
        p.add_(update.reshape(p.shape).to(p.device), alpha=-lr_here)

    @property
    def cost(self) -> float:
        # the global shape: every tp column must assign the same owners
        return ns_cost(self.whole.global_shape, self.hyper["ns_steps"])


def run_jobs(jobs: list[Job], comm: Comm) -> None:
    """One Muon step of every job: the whole ones here, the sharded ones in owner rounds."""
    sharded = [job for job in jobs if job.whole.group is not None]
    for job in jobs:
        if job.whole.group is None:
            job.apply(job.orthogonalize(job.momentum_update(), comm))
    if sharded:
        _run_rounds(sharded, comm)


def _run_rounds(jobs: list[Job], comm: Comm) -> None:
    group = jobs[0].whole.group
    assert all(job.whole.group is group for job in jobs), "one shard group per optimizer"
    world, rank = len(jobs[0].whole.splits), jobs[0].whole.rank
    rounds = rounds_of(assign_owners([job.cost for job in jobs], world))
    received = _start_gather(jobs, rounds[0], rank, comm, 0)
    in_flight: tuple[list[int | None], torch.Tensor, PendingWork] | None = None
    for k, owners in enumerate(rounds):
        full, gathering = received
        gathering.wait(comm.timeout)
        if k + 1 < len(rounds):  # the next gather runs under this round's Newton–Schulz
            received = _start_gather(jobs, rounds[k + 1], rank, comm, k + 1)
        mine = owners[rank]
        update = jobs[mine].orthogonalize(full, comm).reshape(-1) if mine is not None else full
        scattered = _start_scatter(jobs, owners, rank, update, comm, k)
        if in_flight is not None:
            _finish_scatter(jobs, *in_flight, comm)
        in_flight = (owners, *scattered)
    if in_flight is not None:
        _finish_scatter(jobs, *in_flight, comm)


def _start_gather(
    jobs: list[Job], owners: list[int | None], rank: int, comm: Comm, k: int
) -> tuple[torch.Tensor, PendingWork]:
    """Send this rank's fragment of every owner's matrix; receive the whole of its own."""
    device = jobs[0].whole.device
    pieces = [jobs[j].momentum_update() if j is not None else None for j in owners]
    send_splits = [p.numel() if p is not None else 0 for p in pieces]
    send = torch.empty(sum(send_splits), dtype=WIRE, device=device)
    offset = 0
    for piece, n in zip(pieces, send_splits, strict=True):
        if n:
            send[offset : offset + n].copy_(piece.reshape(-1))
            offset += n
    mine = owners[rank]
    out_splits = list(jobs[mine].whole.splits) if mine is not None else [0] * len(owners)
    full = torch.empty(sum(out_splits), dtype=WIRE, device=device)
    work = all_to_all(full, send, out_splits, send_splits, jobs[0].whole.group, comm, f"muon {k}")
    return full, work


def _start_scatter(
    jobs: list[Job],
    owners: list[int | None],
    rank: int,
    update: torch.Tensor,
    comm: Comm,
    k: int,
) -> tuple[torch.Tensor, PendingWork]:
    """Send every rank its fragment of this rank's update; receive this rank's fragments."""
    mine = owners[rank]
    send_splits = list(jobs[mine].whole.splits) if mine is not None else [0] * len(owners)
    out_splits = [jobs[j].whole.param.numel() if j is not None else 0 for j in owners]
    out = torch.empty(sum(out_splits), dtype=WIRE, device=update.device)
    send = update.to(WIRE)
    group = jobs[0].whole.group
    return out, all_to_all(out, send, out_splits, send_splits, group, comm, f"muon {k} back")


def _finish_scatter(
    jobs: list[Job],
    owners: list[int | None],
    received: torch.Tensor,
    work: PendingWork,
    comm: Comm,
) -> None:
    work.wait(comm.timeout)
    offset = 0
    for j in owners:
        if j is not None:
            n = jobs[j].whole.param.numel()
            jobs[j].apply(received[offset : offset + n])
            offset += n
