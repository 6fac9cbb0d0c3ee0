"""``flatshard train --parallelism.pp N``: the GPT cut into pipeline stages, each sharded.

[Note: the trainer's (pp, dp) layout]
With ``parallel.pp = N > 1`` the ``world`` ranks form a mesh ``("pp", "dp")`` of shape
``(N, world // N)`` (pp outermost, torchtitan's order: the dp peers of a stage are consecutive
ranks). Every rank builds the whole GPT from ``cfg.seed`` (the same numbers as an unpipelined
run), keeps the stages of its pp coordinate (``pipeline_stage.GPTStage``: whole-model names),
shards each over ``mesh["dp"]`` with ``fs.shard`` and wraps it in a ``PipelineStage`` on
``mesh["pp"]``'s group. Stage ``s`` of ``pp * v`` lives on pp rank ``s % pp`` (looped
schedules) or on ``0, 1, .., pp-1, pp-1, .., 0`` (V-shaped: ZBVZeroBubble, DualPipeV).

* **Data.** The pp ranks of one dp column read the same batches (the sampler is built for dp
  rank ``rank % dp`` of ``dp``). A step's micro-batches are stacked into one
  ``[rows x micro_batches, seq_len]`` batch that the schedule splits into
  ``parallel.microbatches`` pipeline microbatches; ``position_ids`` go to every stage.
* **Loss.** The schedule runs with ``scale_grads=False`` and a ``loss_fn`` that is
  ``packed_cross_entropy`` normalised by the step's *global* target count (``world_size=dp``,
  the ranks flatshard averages over): summed over the microbatches and averaged over dp, the
  gradient is exactly that of the unpipelined trainer's token-mean loss.
* **Logging.** Only the ranks holding the last stage see losses; the trainer's world
  all-reduce of ``[loss, tokens]`` (other ranks add 0) hands the value to global rank 0.
* **Clipping.** ``fs.clip_grad_norm_(stages, max_norm, across=mesh["pp"])``: the whole
  model's norm on every rank.
* **Validation and the final sample** walk the stages forward by point-to-point sends
  (``pipeline_forward``): torch's ``schedule.eval`` fails on the V-shaped schedules.

The other axes join torchtitan's way, pp outermost and tp innermost (``pipeline_build``):

* **hybrid_shard**: ``"dp"`` becomes ``("replicate", "shard")``, ``shard`` being the dp ranks
  of one stage on one machine, ``replicate`` the machines; each stage is sharded over both.
* **tp**: ``("pp", "dp", "tp")``; the whole GPT is made tensor-parallel (sequence parallel)
  before it is cut, so every stage holds TP modules and sends its tp rank's ``[B, T/tp, C]``
  share of the stream to the same tp rank of the next stage. The losses and token counts
  the world reductions see are tp times too many: divided out. The head's logits are
  gathered. A tied head's copy on the last stage is split as the embedding is (``Shard(0)``,
  ``pipeline_build``), so ``fs.tie_across_stages`` sums the two per tp rank.
* **ep** (MoE GPT): a second mesh ``("pp", "efsdp", "ep")`` splits each stage's dp ranks into
  ep groups; experts are sharded over ``efsdp``, the rest over ``dp`` (``moe.unit_policy``).
  The routers' load-balancing loss joins the gradient inside each stage
  (``pipeline_stage``), weighted per pipeline microbatch: it equals the unpipelined run's
  when the pipeline microbatches are its micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from flatshard.tools.train.config import TrainConfig

__all__ = [
    "LOOPED",
    "Pipeline",
    "StepLoss",
    "check_pp",
    "microbatch_count",
    "stage_indices",
    "stages_per_rank",
]

SINGLE = ("GPipe", "1F1B")
"""Schedules with one stage per rank."""
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
"""Schedules with exactly two stages per rank, placed in a V."""
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
"""Schedules with any number of stages per rank, placed round-robin."""
MIN_MICROBATCHES = {"1F1B": 1, "DualPipeV": 1}
"""Schedules whose microbatches must be at least the number of stages (times this)."""


def stages_per_rank(cfg: TrainConfig) -> int:
    """``parallel.stages_per_rank``, its 0 resolved (1 for GPipe/1F1B, 2 otherwise)."""
    p = cfg.parallel
    return p.stages_per_rank or (1 if p.schedule in SINGLE else 2)


def step_rows(cfg: TrainConfig) -> int:
    """Rows a step feeds the pipeline on each dp rank."""
    return cfg.data.rows * cfg.data.micro_batches


def microbatch_count(cfg: TrainConfig) -> int:
    """``parallel.microbatches``, its 0 resolved (one row per pipeline microbatch)."""
    return cfg.parallel.microbatches or step_rows(cfg)


def _layout_errors(cfg: TrainConfig, world: int) -> str | None:
    p, v = cfg.parallel, stages_per_rank(cfg)
    if world % (p.pp * p.tp):
        tp = f" x parallel.tp={p.tp}" if p.tp > 1 else ""
        return (
            f"parallel.pp={p.pp}{tp} does not divide the world size {world}; pass a "
            f"--parallelism.pp that divides {world // p.tp}, or start a multiple of "
            f"{p.pp * p.tp} ranks"
        )
    if p.tp > 1 and p.loss_parallel:
        return (
            f"parallel.loss_parallel=true cannot be combined with parallel.pp={p.pp} yet "
            "(the last stage gathers its logits); pass --parallelism.loss_parallel false"
        )
    if cfg.model.hf:  # the Llama layout only: see tools/train/pipeline_hf.py
        from flatshard.tools.train.pipeline_hf import hf_pp_error

        if (error := hf_pp_error(cfg, p.pp * v)) is not None:
            return error
    if (p.schedule in SINGLE and v != 1) or (p.schedule in V_SHAPED and v != 2):
        need = 1 if p.schedule in SINGLE else 2
        return (f"parallel.stages_per_rank={v}: schedule {p.schedule} holds exactly {need} "
                f"stage(s) per rank; pass --parallelism.stages_per_rank {need} (or 0)")  # fmt: skip
    return None


def _microbatch_errors(cfg: TrainConfig) -> str | None:
    p, rows, n = cfg.parallel, step_rows(cfg), microbatch_count(cfg)
    if rows % n:
        return (f"parallel.microbatches={n} does not divide the {rows} rows a step feeds the "
                f"pipeline (data.rows={cfg.data.rows} x data.micro_batches="
                f"{cfg.data.micro_batches}); pass a --parallelism.microbatches that divides "
                f"{rows}")  # fmt: skip
    stages = p.pp * stages_per_rank(cfg)
    if p.schedule in MIN_MICROBATCHES and n < stages:
        return (f"parallel.microbatches={n} is fewer than schedule {p.schedule} needs: at "
                f"least the {stages} stages; pass --parallelism.microbatches {stages} or more "
                f"(and data.rows x data.micro_batches a multiple of it)")  # fmt: skip
    return None


def check_pp(cfg: TrainConfig, world: int) -> None:
    """Refuse a pipeline layout this job cannot run, naming the value and the fix."""
    if cfg.parallel.pp == 1:
        return
    error = _layout_errors(cfg, world) or _microbatch_errors(cfg)
    if error is None and not cfg.model.hf:  # hf: its layer count checked by _layout_errors
        from flatshard.tools.train.pipeline_stage import layer_split
        from flatshard.tools.train.resolve import gpt_config

        layers = gpt_config(cfg).n_layers
        try:
            layer_split(layers, cfg.parallel.pp * stages_per_rank(cfg))
        except ValueError as e:
            error = str(e)
    if error is not None:
        raise ValueError(error)


def stage_indices(pp_rank: int, pp: int, per_rank: int, schedule: str) -> list[int]:
    """The global stage indices pp rank ``pp_rank`` holds, in increasing order."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


class StepLoss:
    """The schedule's ``loss_fn`` (last stage): ``packed_cross_entropy`` over the step's
    global target count (``global_tokens``, set before every step)."""

    def __init__(self, dp_world: int) -> None:
        self.dp_world = dp_world
        self.global_tokens = 1

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from flatshard.packing import packed_cross_entropy

        return packed_cross_entropy(logits, labels, self.global_tokens, world_size=self.dp_world)


@dataclass
class Pipeline:
    """This rank's part of the pipeline."""

    mesh: Any
    """The ``("pp", "dp")`` DeviceMesh."""
    stages: list[nn.Module]
    """This rank's sharded stage modules, in stage order."""
    schedule: Any
    """The ``torch.distributed.pipelining`` schedule."""
    loss: StepLoss
    first: bool
    """This rank holds stage 0 (feeds the input ids)."""
    last: bool
    """This rank holds the last stage (computes the losses)."""
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    """One per stage module (the cross-stage checkpoint's unit)."""
    schedulers: list[Any] = field(default_factory=list)
    """One LR schedule per optimizer, stepped together."""

    def step_args(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[tuple, dict]:
        """``schedule.step``'s positional and keyword arguments for this rank's stages."""
        args = (ids,) if self.first else ()
        kwargs: dict[str, Any] = {"target": labels} if self.last else {}
        return args, kwargs
