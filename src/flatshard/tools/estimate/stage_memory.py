"""Memory of one pipeline rank under torch's 1F1B and Interleaved1F1B schedules, with
torchtitan's FSDP2 settings under pipeline parallelism (``--pp``).

[Note: the pipeline stage memory model]
A pp rank runs its stages' forward and backward passes one microbatch at a time, in the order
torch's schedule gives it. The model replays that order (``rank_order``) and sums, at the start
and the end of every pass, what the rank holds then. Each assumption, with its source:

* **The split** (``split_layers``): torchtitan's ``generate_split_points`` (at 9dec370, the
  published runs' commit) gives the first stage ``layers // stages`` blocks, the middle stages
  one more each while the remainder lasts, the last stage the rest: 126 blocks over 8 stages
  are 15, 16 x 6, 15; over 16 stages 7, 8 x 14, 7. Stage ``s`` lives on rank ``s % pp``
  (``stage_ids_this_rank``, style ``loop``); the first stage also holds the embedding, the last
  the final norm and the output head.
* **The order** (``rank_order``): torch's ``Schedule1F1B`` runs ``min(M, pp - rank)`` warm-up
  forwards, then one backward and one forward in turn, then the remaining backwards;
  ``ScheduleInterleaved1F1B`` runs ``min((V - 1) * R + 2 (pp - 1 - rank), M V)`` warm-up
  forwards (``R`` microbatches per round, ``M`` when ``M <= pp``), its local stages in rounds
  of ``R`` microbatches, forwards in stage order and backwards in reverse
  (``_get_1f1b_rank_ops``). With ``M = pp`` rank 0 runs every forward first under both.
* **Parameters gathered for the whole step**: torchtitan sets ``reshard_after_forward=False``
  under PP (``apply_fsdp``: "do not reshard after forward to avoid per-microbatch
  all-gathers"), and torch's stage sets ``reshard_after_backward(False)`` for every backward
  but the reduction (``backward_maybe_with_nosync``, ``perform_reduce_grad``): a stage's
  parameters are gathered from its first forward to its last backward. With float8 the block
  linears are gathered in float8, one byte (``enable_fsdp_float8_all_gather`` in torchtitan's
  ``llama3_405b.toml``); norms and the embedding in bf16, the head in bf16 (not converted).
* **Gradients accumulated unsharded, in the reduce dtype**: torch's stage turns gradient sync
  off (``set_requires_gradient_sync(False)``) until the stage's last backward; FSDP2 then
  keeps each parameter's unsharded gradient, upcast to the reduce dtype
  (``FSDPParam.to_accumulated_grad_if_needed``: fp32 for torchtitan), and adds the next
  microbatches' bf16 gradients into it. So a stage's first backward allocates its whole
  unsharded fp32 gradient, block by block; its last backward is followed by the reduction
  (reduce-scatter, then reshard), which frees the unsharded gradient and the gathered
  parameters and leaves the fp32 gradient shards.
* **Activations per microbatch in flight** (full AC: a block keeps only its input): each block
  input of the stage (``fwd_cache`` keeps them until the backward); a stage after the first
  receives its first block's input into a buffer of its own per
  microbatch, and every stage before the last a buffer per microbatch for the output's
  gradient (``_create_act_recv_info``, ``_create_grad_recv_info``: allocated once per
  microbatch, kept across steps). The last stage holds per microbatch what the head saves
  (``activations.head``) and computes the loss in its forward. While a pass runs, one block's
  transient is added as ``memory.py`` counts it (forward: its input and MLP workspace;
  backward: the recomputed block, its MLP workspace and the gradient flowing between blocks).
* **Outputs kept to the step's end** (``outputs``): the torch of the published runs
  (December 2024) appended every microbatch's output to the stage's ``output_chunks`` on every
  stage (pytorch/pytorch#153383 kept them on the last stage only, from May 2025): a block
  input's size on a stage before the last, the logits (compute dtype) on the last, whose model
  returns them unconverted at torchtitan's 9dec370. After the last backward the schedule
  concatenates the last stage's (``_merge_outputs``: ``torch.cat`` of the local blocks,
  though torchtitan drops the result): the ``merge outputs`` moment.
* **Reserved** (``reserved.py``'s model for FSDP2): the default stream's high-water mark
  without the gradient shards, plus the reduce-scatter pool (every fp32 gradient shard of the
  rank), the all-gather pool (two blocks' flat buffers, or the largest root group), the loss's
  extras on the last stage, vanilla TP's record-stream buffers; and on the rank of the last
  stage the merged outputs (``merged_outputs``): the concatenation is one block of all the
  microbatches' logits, larger than any block the step allocated before it, and the caching
  allocator never joins blocks across segments, so it maps a segment of its own on top of the
  segments the step left reserved (none are released without ``empty_cache``, which
  torchtitan does not call). From the first step on, that segment stays cached.
* **Which rank**: each pp rank is replayed (``rank``); the published figure is the highest
  (the benchmark's footnote: "Different PP ranks can have different peak memory usages. We
  take the maximum across all GPUs"), which ``published.estimate_run`` takes.

Not modelled: compile's and float8's own buffers (as for the other rows), the embedding's
full-sequence partial output before its reduce-scatter, the pipeline's send buffers in flight,
and where the caching allocator places each tensor beyond the merged outputs' segment (probed
on a coarse trace: 10-12 GiB above the live peak under both schedules, moving with the assumed
transients; see docs/estimate.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from flatshard.tools.estimate.activations import FP32, activations
from flatshard.tools.estimate.memory import Phase
from flatshard.tools.estimate.reserved import (
    FSDP2_GATHERS_IN_FLIGHT,
    LOSS_PHASES,
    TP_RECORD_STREAM_BUFFERS,
    loss_extras,
)
from flatshard.tools.estimate.spec import Layout, ModelSpec, Workload
from flatshard.tools.estimate.tp_cost import local_spec

__all__ = [
    "PIPE_SCHEDULES",
    "StageMemory",
    "every_rank",
    "rank_order",
    "split_layers",
    "stage_memory",
]

PIPE_SCHEDULES = ("1F1B", "Interleaved1F1B")
"""The schedules whose order the stage model replays (torch's ``Schedule1F1B`` and
``ScheduleInterleaved1F1B``)."""

FLOAT8_GATHER_BYTES = 1
"""Bytes per gathered block-linear weight with float8: torchtitan's 405B config all-gathers
them in float8 (``enable_fsdp_float8_all_gather = true``)."""

Op = tuple[bool, int, int]
"""(forward?, stage index, microbatch) of one pass."""


def split_layers(layers: int, stages: int) -> tuple[int, ...]:
    """Blocks per stage as torchtitan's ``generate_split_points`` cuts them (see the Note)."""
    if stages > layers:
        raise ValueError(f"{stages} stages need at least {stages} layers, the model has {layers}")
    base, extra = divmod(layers, stages)
    middle = [base + 1 if i < extra else base for i in range(stages - 2)]
    counts = [base, *middle] if stages > 1 else []
    return (*counts, layers - sum(counts))


def _interleaved(pp: int, m: int, v: int, rank: int) -> list[Op]:
    rounds = max(1, m // pp)
    if m % rounds:
        raise ValueError(f"Interleaved1F1B: {m} microbatches are not a multiple of {rounds} rounds")
    per_round = m // rounds
    total = m * v
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), total)

    def fwd_stage(op: int) -> int:
        return (op // per_round) % v * pp + rank

    def bwd_stage(op: int) -> int:
        return (v - 1 - ((op - warmup) // per_round) % v) * pp + rank

    fwd_mb: dict[int, int] = {}
    bwd_mb: dict[int, int] = {}
    order: list[Op] = []
    for op in range(total + warmup):  # warm-up forwards, then F+B pairs, then the rest
        if op < total:
            s = fwd_stage(op)
            order.append((True, s, fwd_mb.setdefault(s, 0)))
            fwd_mb[s] += 1
        if op >= warmup:
            s = bwd_stage(op)
            order.append((False, s, bwd_mb.setdefault(s, 0)))
            bwd_mb[s] += 1
    return order


def rank_order(
    schedule: str, pp: int, microbatches: int, stages_per_rank: int, rank: int
) -> list[Op]:
    """The forward and backward passes of pp rank ``rank``, in torch's order (see the Note)."""
    if schedule == "1F1B":
        warmup = min(microbatches, pp - rank)
        order: list[Op] = [(True, rank, mb) for mb in range(warmup)]
        for mb in range(microbatches):  # 1B1F: a backward, then the next forward if any
            order.append((False, rank, mb))
            if warmup + mb < microbatches:
                order.append((True, rank, warmup + mb))
        return order
    if schedule == "Interleaved1F1B":
        return _interleaved(pp, microbatches, stages_per_rank, rank)
    raise ValueError(f"the stage memory model replays {', '.join(PIPE_SCHEDULES)}, not {schedule}")


@dataclass(frozen=True)
class _Sizes:
    """Bytes per GPU of one block (or one microbatch of one block) and of the root pieces."""

    x: int  # one block's input for one microbatch (sequence-parallel shard)
    fwd: int  # transient while a block runs forward
    bwd: int  # transient while a block runs backward (recomputed block, MLP workspace)
    head: int  # what the head saves per microbatch (final norm, lm_head input, log-softmax)
    logits: int  # the loss's logits (+ fp32 copy), and its gradients in the loss backward
    logits_grads: int
    out: int  # the last stage's output (its logits, compute dtype) for one microbatch
    block: int  # parameters of one block on this TP rank
    block_gathered: int  # bytes of one gathered block (float8 linears: 1 byte)
    embed: int  # embedding rows on this TP rank (the head has as many)


def _sizes(spec: ModelSpec, layout: Layout, mb_work: Workload) -> _Sizes:
    act = activations(spec, layout, mb_work)
    local, p = local_spec(spec, layout.tp), layout.precision
    norms = 2 * spec.hidden  # the two norm weights, never float8
    linears = local.block_params - norms
    gathered = linears * (FLOAT8_GATHER_BYTES if mb_work.float8 else p.param) + norms * p.param
    return _Sizes(
        x=act.block_input,
        fwd=act.block_input + act.mlp_workspace,
        bwd=act.block + act.mlp_workspace + act.grad_input,
        head=act.head,
        logits=act.logits,
        logits_grads=act.logits_grads,
        out=mb_work.tokens * local.vocab * p.act,
        block=local.block_params,
        block_gathered=gathered,
        embed=local.vocab * spec.hidden,
    )


@dataclass(frozen=True)
class _Stage:
    index: int
    blocks: int
    first: bool
    last: bool

    def params(self, z: _Sizes, hidden: int) -> int:
        return (self.blocks * z.block + (z.embed if self.first else 0)
                + ((z.embed + hidden) if self.last else 0))  # fmt: skip

    def gathered(self, z: _Sizes, hidden: int, param_bytes: int) -> int:
        root = (z.embed if self.first else 0) + ((z.embed + hidden) if self.last else 0)
        return self.blocks * z.block_gathered + root * param_bytes

    def held(self, z: _Sizes) -> int:
        """Bytes one microbatch in flight keeps until its backward, its output aside (see
        the Note)."""
        inputs = self.blocks if self.first else self.blocks - 1  # else: the receive buffer
        return inputs * z.x + (z.head if self.last else 0)

    def output(self, z: _Sizes) -> int:
        """One microbatch's output, kept from its forward to the step's end (see the Note)."""
        return z.out if self.last else z.x

    def buffers(self, z: _Sizes, m: int) -> int:
        """Receive buffers, one per microbatch: the input (not the first stage), the output's
        gradient (not the last)."""
        return m * z.x * ((not self.first) + (not self.last))


@dataclass(frozen=True)
class StageMemory:
    """One pp rank's memory over a step (bytes)."""

    rank: int
    stages: tuple[int, ...]
    """Global indices of this rank's stages."""
    blocks: tuple[int, ...]
    """Blocks of each of those stages."""
    peak: int
    """Allocated peak: the largest total over the replayed moments."""
    peak_phase: str
    reserved: int
    """Estimated ``max_memory_reserved`` under FSDP2 (``reserved.py``'s model)."""
    reserved_parts: dict[str, int]
    phases: tuple[Phase, ...] = dataclasses.field(repr=False)

    @property
    def peak_parts(self) -> dict[str, int]:
        return next(p.parts for p in self.phases if p.name == self.peak_phase)


@dataclass
class _State:
    """What a rank holds between passes: microbatches in flight per stage, stages gathered,
    backwards done, stages reduced."""

    held: dict[int, int]
    forwarded: dict[int, int] = dataclasses.field(default_factory=dict)
    gathered: set[int] = dataclasses.field(default_factory=set)
    backwards: dict[int, int] = dataclasses.field(default_factory=dict)
    reduced: set[int] = dataclasses.field(default_factory=set)


def _replay(spec: ModelSpec, layout: Layout, z: _Sizes, stages: list[_Stage], order: list[Op],
            m: int) -> Iterator[Phase]:  # fmt: skip
    """The rank's moments: each pass's start and end (see the Note)."""
    p, c, world = layout.precision, spec.hidden, layout.world
    by = {st.index: st for st in stages}
    shard = {s: -(-st.params(z, c) // world) for s, st in by.items()}  # FSDP2: dim-0 shards
    acc = {s: st.params(z, c) * p.flat for s, st in by.items()}  # unsharded, reduce dtype
    static = {"parameters": sum(shard.values()) * p.master,
              "optimizer": sum(shard.values()) * layout.optimizer_bytes,
              "buffers": len(stages) * spec.max_seq * spec.head_size * FP32,
              "pipe_buffers": sum(st.buffers(z, m) for st in stages)}  # fmt: skip
    state = _State({s: 0 for s in by})
    grad_block = z.block * p.param  # one block's bf16 gradient before it is accumulated
    for fwd, s, mb in order:
        st = by[s]
        if fwd:
            state.gathered.add(s)  # gathered at its first forward, kept (see the Note)
        base = {
            **static,
            "gathered": sum(by[g].gathered(z, c, p.param) for g in state.gathered),
            "unit_grads": sum(acc[t] for t in by
                              if state.backwards.get(t) and t not in state.reduced),
            "gradients": sum(shard[t] for t in state.reduced) * p.grad,
            "outputs": _kept_outputs(state, by, z),
        }  # fmt: skip
        acts = sum(n * by[t].held(z) for t, n in state.held.items())
        where = f"(stage {s}, microbatch {mb})"
        if fwd:
            name = f"loss {where}" if st.last else f"forward {where}"
            work = z.fwd + (z.logits if st.last else 0)
            yield Phase(name, {**base, "activations": acts + st.held(z), "workspace": work})
            state.held[s] += 1
            state.forwarded[s] = state.forwarded.get(s, 0) + 1
            continue
        first = not state.backwards.get(s)
        start = f"loss backward {where}" if st.last else f"backward start {where}"
        work = z.bwd + (z.logits_grads if st.last else 0)
        yield Phase(start, {**base, "activations": acts, "workspace": work,
                            "unit_grads": base["unit_grads"] + grad_block})  # fmt: skip
        # At its first block: the other blocks' inputs are freed; on a first backward the
        # stage's whole unsharded gradient now exists.
        grads = base["unit_grads"] + (acc[s] if first else 0) + grad_block
        yield Phase(f"backward end {where}", {**base, "activations": acts - st.held(z) + z.x,
                                             "workspace": z.bwd, "unit_grads": grads})  # fmt: skip
        state.held[s] -= 1
        state.backwards[s] = state.backwards.get(s, 0) + 1
        if state.backwards[s] == m:  # the reduction: reduce-scatter, then reshard
            state.reduced.add(s)
            state.gathered.discard(s)
    if any(st.last for st in stages):  # the schedule returns the outputs, concatenated
        yield Phase("merge outputs", {**static, "outputs": _kept_outputs(state, by, z),
                                      "merged": m * z.out,
                                      "gradients": sum(shard.values()) * p.grad})  # fmt: skip


def _kept_outputs(state: _State, by: dict[int, _Stage], z: _Sizes) -> int:
    """Every output forwarded so far this step (``output_chunks``, see the Note)."""
    return sum(n * by[t].output(z) for t, n in state.forwarded.items())


def _reserved(spec: ModelSpec, layout: Layout, mb_work: Workload, z: _Sizes,
              stages: list[_Stage], phases: tuple[Phase, ...],
              merged: int) -> dict[str, int]:  # fmt: skip
    """``reserved.py``'s parts for FSDP2 (see its [Note: reserved memory]), and ``merged``,
    the last stage's concatenated outputs in a segment of their own (see the Note)."""
    p, c = layout.precision, spec.hidden
    extra = sum(loss_extras(spec, layout, mb_work).values())
    default = max(ph.total - ph.parts.get("gradients", 0)
                  + (extra if ph.name.split(" (")[0] in LOSS_PHASES else 0)
                  for ph in phases)  # fmt: skip
    shards = sum(-(-st.params(z, c) // layout.world) for st in stages) * p.grad
    roots = [st.gathered(z, c, p.param) - st.blocks * z.block_gathered for st in stages]
    gathers = max(FSDP2_GATHERS_IN_FLIGHT * z.block_gathered, *roots)
    vanilla_tp = layout.tp > 1 and not layout.async_tp
    act = mb_work.tokens * c * p.act
    return {"default_stream": default, "reduce_scatter_pool": shards,
            "all_gather_pool": gathers,
            "tp_record_stream": TP_RECORD_STREAM_BUFFERS * act if vanilla_tp else 0,
            "merged_outputs": merged}  # fmt: skip


def stage_memory(
    spec: ModelSpec,
    layout: Layout,
    work: Workload,
    schedule: str,
    pp: int,
    microbatches: int,
    stages_per_rank: int = 1,
    rank: int = 0,
) -> StageMemory:
    """Memory of pp rank ``rank`` over one step of ``schedule`` (see [Note: the pipeline stage
    memory model]); ``work.batch`` sequences per data-parallel rank, in ``microbatches``."""
    if schedule not in PIPE_SCHEDULES:
        raise ValueError(f"the stage memory model replays {', '.join(PIPE_SCHEDULES)}, not "
                         f"{schedule}")  # fmt: skip
    if schedule == "1F1B" and stages_per_rank != 1:
        raise ValueError("1F1B runs one stage per rank")
    if not work.act_ckpt or layout.cp > 1 or not 0 <= rank < pp:
        raise ValueError("the stage memory model covers full AC (--act-ckpt), cp 1, 0 <= rank "
                         "< pp")  # fmt: skip
    if work.batch % microbatches:
        raise ValueError(f"{microbatches} microbatches do not divide the batch {work.batch}")
    mb_work = dataclasses.replace(work, batch=work.batch // microbatches)
    z = _sizes(spec, layout, mb_work)
    counts = split_layers(spec.layers, pp * stages_per_rank)
    last = len(counts) - 1
    stages = [_Stage(s, counts[s], s == 0, s == last) for s in range(rank, len(counts), pp)]
    order = rank_order(schedule, pp, microbatches, stages_per_rank, rank)
    phases = tuple(_replay(spec, layout, z, stages, order, microbatches))
    peak = max(phases, key=lambda ph: ph.total)
    merged = microbatches * z.out if any(st.last for st in stages) else 0  # see the Note
    parts = _reserved(spec, layout, mb_work, z, stages, phases, merged)
    return StageMemory(rank, tuple(st.index for st in stages),
                       tuple(counts[st.index] for st in stages), peak.total, peak.name,
                       sum(parts.values()), parts, phases)  # fmt: skip


def every_rank(
    spec: ModelSpec, layout: Layout, work: Workload, schedule: str, pp: int, microbatches: int,
    stages_per_rank: int = 1,
) -> list[StageMemory]:  # fmt: skip
    """:func:`stage_memory` of each pp rank, in rank order (the published figures are the
    highest over them: see the Note's "Which rank")."""
    return [stage_memory(spec, layout, work, schedule, pp, microbatches, stages_per_rank, k)
            for k in range(pp)]  # fmt: skip
