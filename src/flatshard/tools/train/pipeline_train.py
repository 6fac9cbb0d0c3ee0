"""One optimizer step through the pipeline schedule.

The pipelined twin of ``trainer.train_step`` (evaluation: ``pipeline_forward``); see [Note: the
trainer's (pp, dp) layout] in ``tools/train/pipeline.py`` for the loss normalisation and logging.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

import flatshard as fs
from flatshard.packing import PackedBatch, global_token_count
from flatshard.tools.train.metrics import peak_memory_mb

Run = Any  # the trainer's Run, not imported: trainer.py imports this module

__all__ = ["pipeline_train_step", "stack"]


def stack(batches: list[PackedBatch]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input_ids``, ``labels``, ``position_ids`` of a step's micro-batches, stacked row-wise
    into ``[rows x micro_batches, seq_len]`` each (the schedule splits them again)."""
    ids = torch.cat([b.input_ids for b in batches])
    labels = torch.cat([b.labels for b in batches])
    positions = torch.cat([b.position_ids for b in batches])
    return ids, labels, positions


def _run_schedule(run: Run, batches: list[PackedBatch]) -> torch.Tensor:
    """Forward and backward of the step; this rank's summed microbatch losses (0 off the last
    stage). Every pp and tp rank of a dp column counts the same labels: the world count is
    pp x tp times the step's."""
    pipe = run.pipe
    copies = run.env.pp * run.env.tp
    pipe.loss.global_tokens = global_token_count([b.labels for b in batches]) // copies
    ids, labels, positions = stack(batches)
    args, kwargs = pipe.step_args(ids, labels)
    losses: list[torch.Tensor] = []
    keep = run.cfg.parallel.pp_keep_gathered  # one gather per unit per step (torchtitan's)
    with fs.pipeline_step(pipe.schedule, keep_gathered=keep):  # one reduction per unit
        pipe.schedule.step(*args, **kwargs, losses=losses, position_ids=positions)
    if not losses:
        return torch.zeros((), device=run.env.device)
    return torch.stack([loss.detach().float() for loss in losses]).sum()


def pipeline_train_step(run: Run, batches: list[PackedBatch]) -> dict[str, float]:
    """One optimizer step of every stage; the same dict as ``trainer.train_step``."""
    pipe, env = run.pipe, run.env
    stats = torch.zeros(2, device=env.device)  # [loss on the last stage, real tokens]
    stats[0] = _run_schedule(run, batches)
    stats[1] = sum((b.input_ids != run.corpus.tokenizer.pad_id).sum() for b in batches)
    clip = run.cfg.optim.grad_clip
    max_norm = clip if clip > 0 else float("inf")
    grad_norm = fs.clip_grad_norm_(pipe.stages, max_norm, across=pipe.mesh["pp"])
    dist.all_reduce(stats)  # the last stage's losses reach rank 0 (tp times); tokens pp x tp
    loss, norm = stats[0].item() / (env.dp_world * env.tp), grad_norm.item()
    skip = not (math.isfinite(loss) and math.isfinite(norm))  # global values: every rank
    if skip and run.cfg.optim.nonfinite == "error":
        raise FloatingPointError(
            f"step {run.step + 1}: the loss is {loss} and the gradient norm {norm}; the run "
            "diverged or the data is bad. Lower optim.lr, or set optim.nonfinite=skip to skip "
            "such steps, and continue from the last checkpoint with --resume"
        )
    for optimizer, scheduler in zip(pipe.optimizers, pipe.schedulers, strict=True):
        if not skip:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    if run.cfg.model.float8 and not skip:  # the next gathers skip their amax all-reduce
        for stage in pipe.stages:
            fs.precompute_float8_scales(stage)
    memory = torch.tensor(peak_memory_mb(env.device), device=env.device)
    dist.all_reduce(memory, op=dist.ReduceOp.MAX)
    return {
        "loss": loss,
        "tokens": stats[1].item() / (env.pp * env.tp),
        "grad_norm": norm,
        "peak_mem_mb": memory.item(),
        "skipped": float(skip),
    }
