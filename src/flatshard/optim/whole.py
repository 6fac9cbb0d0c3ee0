"""Where each fragment sits in its whole parameter, and who computes what for it.

[Note: whole-parameter optimizers]
Muon and Adafactor are not elementwise: Muon orthogonalises each matrix's momentum, Adafactor
reduces each matrix's squared gradient over rows and columns and scales by the parameter's RMS.
On flatshard's 1-D fragments (a contiguous range of the flattened parameter, possibly empty)
they need facts about the whole parameter. ``WholeParam`` holds them for one fragment: the full
shape, this rank's flat range, every shard rank's fragment length (they tile the flattened
parameter in rank order, so concatenating the fragments in rank order *is* the parameter), and
the shard group. A plain tensor (not sharded, or ``no_shard``'s full fragments) is its own
whole: group ``None``, no collective.

Every rank builds the same list of ``WholeParam`` in the same order (the optimizer's param
groups, skipping parameters without a gradient: flatshard agrees on gradient None-ness across
ranks), so every rank issues the same collectives in the same order. Under hybrid_shard the
gradients are identical across replica groups: each shard group does the work on its own.

With tensor parallelism (see [Note: tensor-parallel parameters]) the fragments tile the
parameter's *TP-local block*, not the matrix: ``shape``, ``start`` and ``splits`` describe the
block, ``tp`` (its ``TPSpec``) where the block sits in the global matrix. The global matrix is
spread over the dp ranks *and* the tp peers (``Shard(0)`` rows, ``Shard(1)`` columns) or held
alike by every tp peer (``Replicate()``; plain parameters of a TP model too). Muon gathers the
block over dp to its owner as without TP, then the tp peers of that owner (the same dp rank in
every tp column: owners are assigned from the *global* shapes, so every column makes the same
plan) all-gather the blocks into the matrix, each orthogonalises it and keeps its own block of
the update (muon_rounds.py). Adafactor places each block's row/column sums at the block's
global rows/columns and sums them over tp after dp; a replicated parameter's sums come from tp
rank 0 only, so they count once (tp_stats.py). Every tp peer runs the same rounds and reduces,
so the collectives still match.
"""

from __future__ import annotations

import datetime
import heapq
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flatshard.comm.collectives import CommStats
from flatshard.core.layout import overlap
from flatshard.core.params import fragment_tag
from flatshard.parallel.tensor import TPSpec

DEFAULT_TIMEOUT = datetime.timedelta(seconds=600)


@dataclass(frozen=True)
class WholeParam:
    """One parameter the optimizer steps on, as this rank holds it."""

    param: torch.Tensor
    """This rank's fragment (or the plain tensor itself)."""
    shape: torch.Size
    """The full shape of the original parameter."""
    start: int
    """This rank's fragment is the elements ``[start, start + param.numel())`` of the flattened
    parameter."""
    splits: tuple[int, ...]
    """Every shard rank's fragment length, in shard-rank order (sums to ``numel``)."""
    group: dist.ProcessGroup | None
    """The shard group (None: this rank holds the whole parameter)."""
    rank: int
    """This rank's index in ``group`` (0 without a group)."""
    device: torch.device
    """Where collectives on it run (the model's compute device)."""
    tp: TPSpec | None = None
    """A tensor-parallel parameter's ``TPSpec`` (the fields above then describe its TP-local
    block; ``tp.shape`` is the global matrix), None for a plain one."""
    tp_group: dist.ProcessGroup | None = None
    """This rank's tp peers in a tensor-parallel model (None without TP), for plain
    parameters too: every tp peer holds those whole, so their statistics must count once."""

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def global_shape(self) -> torch.Size:
        """The shape of the matrix the optimizer's math is about (the global one with TP)."""
        return self.shape if self.tp is None else self.tp.shape

    @property
    def global_numel(self) -> int:
        return self.global_shape.numel()

    @property
    def counts_once(self) -> bool:
        """Whether this rank's statistics of the parameter are summed over tp as they are:
        without TP, or for a parameter split over tp; a replicated one's (held alike by every
        tp peer) only on tp rank 0."""
        if self.tp_group is None or (self.tp is not None and self.tp.is_sharded):
            return True
        return dist.get_rank(self.tp_group) == 0

    @property
    def end(self) -> int:
        return self.start + self.param.numel()


@dataclass(frozen=True)
class Comm:
    """The counters and the bound on waits of the collectives of one optimizer."""

    stats: CommStats
    timeout: datetime.timedelta


def whole_param(param: torch.Tensor) -> WholeParam:
    """The ``WholeParam`` of a flatshard fragment or a plain tensor."""
    tag = fragment_tag(param)
    state = tag.state() if tag is not None else None
    if tag is None or state is None:
        return WholeParam(param, param.shape, 0, (param.numel(),), None, 0, param.device)
    flat_group = state.units[tag.unit].groups[tag.group]
    spec = flat_group.specs[tag.index]
    topo = state.topology
    splits = tuple(
        _fragment_length(spec.offset, spec.numel, flat_group.shard_numel, r)
        for r in range(flat_group.world)
    )
    assert sum(splits) == spec.numel and splits[topo.shard_rank] == param.numel(), splits
    tp_group = state.tp.group if state.tp is not None else None
    return WholeParam(
        param, tag.full_shape, tag.flat_range[0], splits, topo.shard_group,
        topo.shard_rank, state.device, tag.tp, tp_group,
    )  # fmt: skip


def _fragment_length(offset: int, numel: int, shard_numel: int, rank: int) -> int:
    """How many elements of a parameter at ``offset`` the shard of ``rank`` holds."""
    start, end = overlap(offset, numel, rank * shard_numel, (rank + 1) * shard_numel)
    return end - start


def comm_of(params: list[torch.Tensor]) -> Comm:
    """The sharded model's ``CommStats`` (so ``fs.comm_stats`` and debug mode see the
    optimizer's collectives) and timeout; fresh counters for plain tensors."""
    for p in params:
        tag = fragment_tag(p)
        state = tag.state() if tag is not None else None
        if state is not None:
            return Comm(state.stats, state.timeout)
    return Comm(CommStats(), DEFAULT_TIMEOUT)


def check_one_model(params: list[torch.Tensor], where: str) -> None:
    """``ValueError`` unless the parameters are all fragments of one sharded model, or all
    plain tensors (collectives need one shard group that every rank agrees on)."""
    states = {id(s) for p in params if (t := fragment_tag(p)) is not None and (s := t.state())}
    plain = sum(1 for p in params if fragment_tag(p) is None)
    if len(states) > 1 or (states and plain):
        raise ValueError(
            f"{where}: the parameters mix {len(states)} sharded model(s) and {plain} plain "
            "tensor(s); build one optimizer per sharded model from its model.parameters()"
        )


def assign_owners(costs: list[float], world: int) -> list[list[int]]:
    """Per rank, the jobs (indices into ``costs``) it computes: the largest first, each to the
    least loaded rank (ties: the lowest rank), in assignment order. Deterministic, so every
    rank derives the same plan."""
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    loads = [(0.0, r) for r in range(world)]
    owned: list[list[int]] = [[] for _ in range(world)]
    for job in order:
        load, r = heapq.heappop(loads)
        owned[r].append(job)
        heapq.heappush(loads, (load + costs[job], r))
    return owned


def rounds_of(owned: list[list[int]]) -> list[list[int | None]]:
    """Round k holds every rank's k-th job (None where a rank has no more): each round every
    rank computes at most one whole parameter."""
    depth = max((len(jobs) for jobs in owned), default=0)
    return [[jobs[k] if k < len(jobs) else None for jobs in owned] for k in range(depth)]
