"""``fs.tie_across_stages``: one parameter held by several pipeline stages, kept one parameter.

A language model whose head shares the embedding's weight, cut into stages, holds that weight
twice: on the first stage (the embedding) and on the last (the head), often on different pp
ranks. Single-process training gives the one weight the *sum* of both uses' gradients; two
independent copies would each get their own half and drift apart. Declared once, after the
schedule is built::

    ties = fs.tie_across_stages(schedule, [{0: "embed.weight", n_stages - 1: "head.weight"}])
    with fs.pipeline_step(schedule):          # applies the ties declared on the schedule
        schedule.step(...)
    opt.step()                                # both copies take the same step

[Note: tied parameters across stages]
Each copy is sharded over its own stage's dp mesh, and two stages' flat layouts need not
split the weight at the same elements (other parameters, other padding), so fragments are
never matched piecewise. At the end of ``fs.pipeline_step``, after the reduction assigned
``.grad``, each copy's gradient is laid into a zero tensor of the full (TP-local) size at its
fragment's ``flat_range`` and summed over the copy's shard group: every rank of the stage then
holds that copy's whole gradient. The copies of this rank are added up, then summed over the
schedule's pp group when more than one pp rank holds a copy (ranks holding none add zeros;
a V-shaped schedule holds both ends on one rank and needs no pp collective). Each copy takes
its fragment's slice of the total: every copy sees the single-process gradient, so equal
copies stay equal under any element-wise optimizer. One extra element counts the ranks whose
copy had a gradient, so a weight no stage used keeps ``.grad = None`` as in one process.
Declaring checks, on every pp rank alike (one ``all_gather_object``), that each named stage is
held by a rank, that the names exist, are flatshard fragments of equal shape and dtype, and
that the copies hold equal values now (a hash of each whole copy).

[Note: tensor-parallel tied copies]
A copy that is a DTensor (``parallelize_module`` ran on its stage) lives in its stage's flat
groups as its TP-local block (parallel/tensor.py): its fragment's ``flat_range`` indexes this
tp rank's block, its ``.grad`` is the fp32 sharded gradient of that block, averaged over dp
only. The pp group of a schedule built on a ``("pp", ..., "tp")`` mesh joins the ranks of
equal dp *and* tp coordinates, so the sum above, unchanged, adds the blocks this tp rank holds
of each copy. That is the single-process gradient only if the blocks are the same elements of
the weight on every stage: the copies must have equal global shapes and equal placements on
tp meshes of equal size, and each tp rank's block must start at the same place (its origin).
Declaring checks all three, and refuses different placements rather than redistributing:

* the trainer's GPT (and torchtitan's plans) already split both alike: the embedding
  rowwise (vocabulary rows) and the head colwise (vocabulary columns) both shard the
  ``[vocab, d_model]`` weight on dim 0, ``Shard(0)``;
* it is the only layout a tied model has in one process (one DTensor, one placement:
  [Note: tied embeddings] in models/tensor_parallel.py), so a pipeline that matches it loses
  nothing;
* matching a ``Shard(1)`` copy to a ``Shard(0)`` one would cost, every step, the whole
  gradient on every tp rank (an all-gather of ``vocab x d_model`` over tp, then a slice), and
  the optimizer would hold the same element at different places of the two stages; a plan
  avoids all that by giving both modules the same split.

Each TP copy's digest covers every tp rank's (origin, block digest), gathered over its tp mesh
(the tp peers hold the same stages): every rank of the pipeline sees the same facts and raises
alike, even when only one tp rank's block differs.

Gradient norms: all copies but the first (lowest stage index) are marked as duplicates
(``is_tied_duplicate``) so that a norm over the whole model can count the weight once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flatshard.comm.collectives import all_reduce
from flatshard.core.params import fragment_tag
from flatshard.core.state import STATE_ATTR, ShardedState
from flatshard.parallel.pipeline_checks import schedule_stages
from flatshard.parallel.tensor import TPSpec

TIES_ATTR = "_flatshard_ties"  # on the schedule: its TiedParameters, applied by pipeline_step
DUPLICATE_ATTR = "_flatshard_tied_duplicate"  # on a fragment: not the first copy of its tie


def is_tied_duplicate(param: torch.Tensor) -> bool:
    """A fragment of a tied copy other than the first (its gradient equals the first's)."""
    return getattr(param, DUPLICATE_ATTR, False)


@dataclass(frozen=True)
class TiedCopy:
    """One copy of a tied parameter on this rank: a fragment of one stage's sharded module."""

    stage_index: int
    name: str
    fragment: nn.Parameter
    state: ShardedState
    flat_range: tuple[int, int]
    shape: torch.Size  # of the whole (TP-local) parameter
    tp: TPSpec | None = None  # a tensor-parallel copy: its DTensor's mesh and placements

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclass(frozen=True)
class Tie:
    """One tied parameter: this rank's copies (by stage index) and whether pp ranks share it."""

    copies: tuple[TiedCopy, ...]
    numel: int
    dtype: torch.dtype
    across_pp: bool  # more than one pp rank holds a copy: sum over the pp group


class TiedParameters:
    """The ties of one schedule (``fs.tie_across_stages``); ``fs.pipeline_step`` calls
    ``sum_gradients`` after each step's reduction."""

    def __init__(self, ties: list[Tie], pp_group, stats, device: torch.device) -> None:
        self.ties, self.pp_group, self.stats = ties, pp_group, stats
        self.device = device  # where a rank holding no copy of a tie adds its zeros

    @torch.no_grad()
    def sum_gradients(self) -> None:
        """Give every copy the sum of all copies' gradients ([Note: tied parameters across
        stages]). Every rank of the pipeline calls it (the collectives are the same)."""
        for tie in self.ties:
            total = torch.zeros(tie.numel + 1, dtype=tie.dtype, device=self._device(tie))
            for copy in tie.copies:
                total += _whole_grad(copy, tie, total.device)
            if tie.across_pp:
                all_reduce(total, self.pp_group, self.stats, name="tied_all_reduce")
            for copy in tie.copies:
                start, end = copy.flat_range
                grad = total[start:end].to(copy.fragment.device).clone()
                copy.fragment.grad = grad if total[-1].item() > 0 else None

    def _device(self, tie: Tie) -> torch.device:
        return tie.copies[0].state.device if tie.copies else self.device


def _whole_grad(copy: TiedCopy, tie: Tie, device: torch.device) -> torch.Tensor:
    """The copy's whole gradient (and a 1 when this rank's fragment had one), summed over its
    stage's shard group."""
    whole = torch.zeros(tie.numel + 1, dtype=tie.dtype, device=device)
    grad = copy.fragment.grad
    if grad is not None:
        start, end = copy.flat_range
        whole[start:end] = grad.reshape(-1).to(device, tie.dtype)
        whole[-1] = 1
    all_reduce(whole, copy.state.group, copy.state.stats, name="tied_gather_all_reduce")
    return whole


def _whole_value(copy: TiedCopy) -> torch.Tensor:
    """The copy's whole (TP-local) value, assembled over its stage's shard group."""
    frag = copy.fragment.detach()
    whole = torch.zeros(copy.numel, dtype=frag.dtype, device=copy.state.device)
    start, end = copy.flat_range
    whole[start:end] = frag.reshape(-1).to(whole.device)
    all_reduce(whole, copy.state.group, copy.state.stats, name="tied_gather_all_reduce")
    return whole


def tie_across_stages(schedule, ties: Sequence[Mapping[int, str]]) -> TiedParameters:
    """Declare parameters that several stages of ``schedule`` hold copies of: each mapping of
    ``ties`` is one parameter, ``{stage_index: name in that stage's module, ...}`` (e.g.
    ``{0: "embed.weight", n_stages - 1: "head.weight"}``). From then on ``fs.pipeline_step``
    gives every copy the sum of the copies' gradients, so they stay equal and train as one
    parameter ([Note: tied parameters across stages]). Every rank of the pipeline calls it
    with the same ``ties``, after ``fs.shard`` of its stages; the copies must be equal now.
    ``ValueError`` (on every pp rank) for a stage no rank holds, a missing name, copies of
    different shapes, values or tensor-parallel placements ([Note: tensor-parallel tied
    copies]). Returns the declaration (also kept on the schedule)."""
    stages = schedule_stages(schedule)
    specs = _validate_spec(ties, stages[0].num_stages)
    states = [getattr(stage.submod, STATE_ATTR, None) for stage in stages]
    unsharded = [s.stage_index for s, state in zip(stages, states, strict=True) if state is None]
    mine, problems = _local_copies(specs, {stage.stage_index: stage for stage in stages})
    if unsharded:
        problems.append(f"stage(s) {unsharded} are not sharded: fs.shard them")
    everyone: list = [None] * stages[0].group_size
    dist.all_gather_object(everyone, (_facts(mine), problems), group=stages[0].group)
    _agree(specs, everyone, stages[0].group_rank)
    made = []
    for t, (copies, spec) in enumerate(zip(mine, specs, strict=True)):
        held = [f for facts_r, _ in everyone for f in facts_r[t]]
        across_pp = sum(1 for facts_r, _ in everyone if facts_r[t]) > 1
        for c in copies:  # the first copy counts in gradient norms, the others do not
            setattr(c.fragment, DUPLICATE_ATTR, c.stage_index != min(spec))
        shape, dtype = torch.Size(held[0][5]), getattr(torch, held[0][2].split(".")[-1])
        made.append(Tie(tuple(copies), shape.numel(), dtype, across_pp))
    tied = TiedParameters(made, stages[0].group, states[0].stats, states[0].device)
    setattr(schedule, TIES_ATTR, tied)
    return tied


def _validate_spec(ties, n_stages: int) -> list[dict[int, str]]:
    """``ties`` as a list of ``{stage_index: name}`` (sorted by stage), or a clear error."""
    if isinstance(ties, Mapping | str) or not isinstance(ties, Sequence) or not ties:
        raise TypeError(
            f"fs.tie_across_stages(schedule, ties): ties={ties!r} must be a non-empty list of "
            'mappings, e.g. [{0: "embed.weight", ' + f'{n_stages - 1}: "head.weight"' + "}]"
        )
    out = []
    for t, spec in enumerate(ties):
        bad = not isinstance(spec, Mapping) or len(spec) < 2
        bad = bad or not all(isinstance(i, int) and 0 <= i < n_stages for i in spec)
        if bad or not all(isinstance(n, str) for n in spec.values()):
            raise ValueError(
                f"fs.tie_across_stages: ties[{t}]={spec!r} must map two or more stage indices "
                f"(0 to {n_stages - 1}) to parameter names in those stages' modules"
            )
        out.append(dict(sorted(spec.items())))
    return out


def _local_copies(specs: list[dict[int, str]], by_index: dict) -> tuple[list, list]:
    """Per tie, the copies this rank's stages hold; and what is wrong with them (messages)."""
    mine, problems = [], []
    for t, spec in enumerate(specs):
        copies = []
        for index, name in spec.items():
            if index not in by_index:
                continue
            module = by_index[index].submod
            param = dict(module.named_parameters()).get(name)
            tag = fragment_tag(param) if param is not None else None
            where = f"ties[{t}]: stage {index} ({type(module).__name__}) parameter {name!r}"
            if param is None:
                names = [n for n, _ in module.named_parameters()][:8]
                problems.append(f"{where} does not exist (it has {names} ...)")
            elif tag is None or tag.state() is None:
                problems.append(f"{where} is not sharded: fs.shard the stage first")
            else:  # plain or tensor-parallel ([Note: tensor-parallel tied copies])
                state, tp = tag.state(), tag.tp
                assert tp is None or isinstance(tp, TPSpec)
                copies.append(
                    TiedCopy(index, name, param, state, tag.flat_range, tag.full_shape, tp)
                )
        mine.append(copies)
    return mine, problems


def _facts(mine: list[list[TiedCopy]]) -> list[list[tuple]]:
    """Per tie, what this rank tells its pp peers of each copy it holds: (stage index, global
    shape, dtype, tensor-parallel layout or None, digest of its value, TP-local shape)."""
    return [[_copy_facts(c) for c in copies] for copies in mine]


def _copy_facts(c: TiedCopy) -> tuple:
    digest = _digest(_whole_value(c))
    if c.tp is None:
        return (c.stage_index, tuple(c.shape), str(c.fragment.dtype), None, digest, tuple(c.shape))
    mesh: Any = c.tp.mesh  # a 1-D DeviceMesh (TPSpec keeps it untyped)
    layout = f"{list(c.tp.placements)} over {mesh.size()} tp ranks"
    digest = _tp_digest(c.tp, digest)
    return (c.stage_index, tuple(c.tp.shape), str(c.fragment.dtype), layout, digest, tuple(c.shape))


def _tp_digest(tp: TPSpec, local: str) -> str:
    """One hash of every tp rank's (origin, digest of its block), the same on all of them
    ([Note: tensor-parallel tied copies])."""
    mesh: Any = tp.mesh
    group = mesh.get_group()
    pieces: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(pieces, (tuple(tp.origin), local), group=group)
    return hashlib.sha256(repr(pieces).encode()).hexdigest()


def _digest(whole: torch.Tensor) -> str:
    """A hash of a tensor's bytes: equal copies, equal digests."""
    data = whole.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    raw = bytearray(data.numel())  # copied out by torch alone: numpy is no dependency
    if raw:
        torch.frombuffer(raw, dtype=torch.uint8).copy_(data)
    return hashlib.sha256(raw).hexdigest()


def _agree(specs: list[dict[int, str]], everyone: list, my_rank: int) -> None:
    """Raise on every pp rank alike if any rank found a problem or the copies differ."""
    prefix = f"fs.tie_across_stages (pp rank {my_rank}): "
    problems = [f"pp rank {r}: {m}" for r, (_, ps) in enumerate(everyone) for m in ps]
    for t, spec in enumerate(specs):
        if problems:
            break  # a rank could not report its copies: the rest would mislead
        problem = _tie_problem(t, spec, [f for facts_r, _ in everyone for f in facts_r[t]])
        if problem is not None:
            problems.append(f"ties[{t}]: {problem}")
    if problems:
        raise ValueError(prefix + "; ".join(problems))


def _tie_problem(t: int, spec: dict[int, str], facts: list[tuple]) -> str | None:
    """What is wrong with the copies of ``ties[t]`` as their holders report them, or None."""
    missing = [i for i in spec if i not in [f[0] for f in facts]]
    if missing:
        return (
            f"stage(s) {missing} are held by no pp rank of this schedule; use the "
            "stage_index of its PipelineStage"
        )
    if len({(f[1], f[2]) for f in facts}) > 1:
        sizes = {spec[f[0]]: f"{list(f[1])} {f[2]}" for f in facts}
        return f"the copies differ in size or dtype {sizes}; tie parameters of one shape"
    if len({f[3] for f in facts}) > 1:
        layouts = {spec[f[0]]: f[3] or "not tensor-parallel" for f in facts}
        return (
            f"the copies are split over tensor-parallel ranks differently {layouts}; give "
            "both the same placements (e.g. RowwiseParallel for an embedding and "
            "ColwiseParallel for the head: both Shard(0)), see [Note: tensor-parallel tied "
            "copies] in flatshard/parallel/pipeline_tied.py"
        )
    if len({f[4] for f in facts}) > 1:
        return (
            f"the copies {list(spec.values())} hold different values; make them equal "
            "before fs.shard (e.g. head.weight.data.copy_(embed.weight.data))"
        )
    return None
