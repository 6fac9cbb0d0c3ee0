"""The training loop of ``flatshard train``: one function per phase, run on every worker.

[Note: lockstep]
Every forward and backward of the sharded model runs collectives, so every rank must run the
same number of them, in the same order: the same number of micro-batches per step (the sampler
guarantees it, padding with empty micro-batches), the same validation micro-batch count, and
the same number of generation steps for the final sample (no early stop at eos). Decisions that
depend on the file system (is there a checkpoint to resume?) are taken by rank 0 and broadcast.
Skipping a non-finite step (``optim.nonfinite``) is decided on the all-reduced loss and the
global gradient norm, values every rank holds identically: no extra collective, no divergence.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import flatshard as fs
from flatshard.models import GPT
from flatshard.packing import PackedBatch, global_token_count, packed_cross_entropy
from flatshard.tools.train import cp_plan, hf_model, moe
from flatshard.tools.train import tp_plan as tensor_parallel
from flatshard.tools.train.build import Env
from flatshard.tools.train.config import TrainConfig
from flatshard.tools.train.data import Corpus, to_batch
from flatshard.tools.train.metrics import MetricsLog, peak_memory_mb
from flatshard.tools.train.pipeline_forward import pipeline_evaluate, pipeline_generate
from flatshard.tools.train.pipeline_train import pipeline_train_step
from flatshard.tools.train.plots import write_plots

__all__ = ["Run", "evaluate", "sample_text", "train_loop", "train_step"]


@dataclass
class Run:
    """Everything a worker trains with (built by :func:`flatshard.tools.train.session.setup`)."""

    cfg: TrainConfig
    env: Env
    model: GPT
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    corpus: Corpus
    sampler: Any  # PackedBatchSampler
    stream: Any  # the endless iterator over the sampler
    val_steps: list[list[int]]
    ckpt: Any  # CheckpointManager | None
    log: MetricsLog | None  # rank 0 only
    flops_per_token: int
    peak_flops: float | None
    step: int = 0
    tokens_seen: int = 0
    elapsed_s: float = 0.0
    skipped_steps: int = 0  # steps whose update was skipped (optim.nonfinite = "skip")
    last: dict[str, Any] = field(default_factory=dict)
    plots_note: str | None = None  # the last plot attempt: None none yet, "" written, else why not
    pipe: Any = None  # train.pipeline.Pipeline with --parallelism.pp > 1 (model: its stages)
    cp: Any = None  # models.context_parallel.ContextParallel with --parallelism.cp > 1

    @property
    def out(self) -> Path:
        return Path(self.cfg.out)

    def say(self, text: str) -> None:
        """Print on rank 0 (above the progress bar if there is one)."""
        if self.log is not None:
            self.log.print(text)


def train_step(run: Run, batches: list[PackedBatch]) -> dict[str, float]:
    """One optimizer step over this rank's micro-batches; the loss is normalised over the
    step's global target tokens. Returns the global loss, real tokens, gradient norm and whether
    the update was skipped (a non-finite loss or norm under ``optim.nonfinite = "skip"``)."""
    world = run.env.world
    batches = [_local(run, b) for b in batches]  # cp > 1: this rank's share of every row
    # every tp rank of a dp group counts the same tokens: G and W both tp times too large, so
    # W / G is the data-parallel factor (see [Note: the trainer's (dp, tp) layout])
    targets = global_token_count([b.labels for b in batches])  # one all-reduce, all ranks
    stats = torch.zeros(2, device=run.env.device)  # [loss, real tokens]; no host sync per batch
    for b in batches:  # the same count on every rank
        with tensor_parallel.loss_context(run.cfg):
            logits = _logits(run, b)  # [R, T, V] (T / cp tokens with cp > 1)
            loss = packed_cross_entropy(logits, b.labels, targets, world_size=world)
            balance = moe.aux_loss(run.model, len(batches))  # MoE: load balancing, else None
            (loss if balance is None else loss + balance).backward()
        stats[0] += tensor_parallel.scalar(loss.detach()).float()
        stats[1] += (b.input_ids != run.corpus.tokenizer.pad_id).sum()
    clip = run.cfg.optim.grad_clip
    grad_norm = fs.clip_grad_norm_(run.model, max_norm=clip if clip > 0 else float("inf"))
    # rank r's loss is W * (its token-loss sum) / G, so the global mean is (sum over ranks) / W
    dist.all_reduce(stats)
    loss, norm = stats[0].item() / world, grad_norm.item()
    skip = not (math.isfinite(loss) and math.isfinite(norm))  # global values: same on all ranks
    if skip and run.cfg.optim.nonfinite == "error":
        raise FloatingPointError(
            f"step {run.step + 1}: the loss is {loss} and the gradient norm {norm}; the run "
            "diverged or the data is bad. Lower optim.lr, or set optim.nonfinite=skip to skip "
            "such steps, and continue from the last checkpoint with --resume"
        )
    if not skip:
        run.optimizer.step()
        if run.cfg.model.float8:  # the next gathers skip their amax all-reduce (docs/float8.md)
            fs.precompute_float8_scales(run.model)
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()  # the schedule moves on either way
    memory = torch.tensor(peak_memory_mb(run.env.device), device=run.env.device)
    dist.all_reduce(memory, op=dist.ReduceOp.MAX)
    return {
        "loss": loss,
        "tokens": stats[1].item() / run.env.tp,
        "grad_norm": norm,
        "peak_mem_mb": memory.item(),
        "skipped": float(skip),
    }


@torch.no_grad()
def evaluate(run: Run) -> float | None:
    """Mean token loss over the fixed validation micro-batches (None without validation data)."""
    if not run.val_steps:
        return None
    if run.pipe is not None:
        return pipeline_evaluate(run)
    run.model.eval()
    totals = torch.zeros(2, device=run.env.device)  # [token-loss sum, target count]
    for indices in run.val_steps:  # the same count on every rank
        b = to_batch(run.corpus.val, indices, run.cfg.data, run.env.device, _pad(run))
        b = _local(run, b)
        logits = tensor_parallel.full_logits(_logits(run, b))
        totals[0] += GPT.loss(logits, b.labels, reduction="sum")
        totals[1] += b.num_targets
    run.model.train()
    dist.all_reduce(totals)
    return (totals[0] / totals[1].clamp(min=1)).item()


@torch.no_grad()
def sample_text(run: Run) -> str:
    """A top-k sample from the final model. Every rank generates with the same prompt and seed
    (identical results) for exactly ``sample_tokens`` forwards: each forward all-gathers."""
    log = run.cfg.log
    device = run.env.device
    tokenizer = run.corpus.tokenizer
    ids = torch.tensor(tokenizer.encode(log.sample_prompt, add_eos=False), device=device)
    gen = torch.Generator(device=device).manual_seed(run.cfg.seed)
    modules = run.pipe.stages if run.pipe is not None else [run.model]
    for module in modules:
        module.eval()
    if run.pipe is not None:
        out = pipeline_generate(run, ids, log.sample_tokens, gen)
    elif run.env.tp > 1:
        out = tensor_parallel.generate(run.model, ids, log.sample_tokens, run.env.tp, gen)
    elif run.cfg.model.experts:
        out = moe.generate(run.model, ids, log.sample_tokens, gen)
    else:
        out = hf_model.generate(run.model, ids, log.sample_tokens, 0.8, 20, gen)
    for module in modules:
        module.train()
    out_ids = out.tolist()
    if tokenizer.eos_id in out_ids[len(ids) :]:  # cut at the first end-of-document
        out_ids = out_ids[: out_ids.index(tokenizer.eos_id, len(ids))]
    return tokenizer.decode(out_ids)


def _local(run: Run, batch: PackedBatch) -> PackedBatch:
    """This rank's share of ``batch``: all of it, or with cp > 1 its head-tail part of every
    row (see [Note: the trainer's (dp, cp) layout]); each token then counts on one rank only,
    so the world-group reductions of loss, targets and tokens stay exact."""
    if run.cp is None:
        return batch
    return cp_plan.local_batch(batch, run.env.cp, run.env.cp_rank)


def _logits(run: Run, batch: PackedBatch) -> torch.Tensor:
    """The model's logits of (this rank's share of) ``batch``."""
    if run.cp is None:
        return hf_model.logits(run.model, batch)
    return cp_plan.cp_logits(run.model, run.cp, batch)


def _pad(run: Run) -> int:
    return run.corpus.tokenizer.pad_id


def _row(run: Run, step: int, lr: float, out: dict[str, float], seconds: float) -> dict[str, Any]:
    """The metrics.jsonl row of one step."""
    tokens_per_s = out["tokens"] / seconds
    mfu = None
    if run.peak_flops:
        mfu = run.flops_per_token * tokens_per_s / (run.peak_flops * run.env.world)
    return {
        "step": step,
        "loss": out["loss"],
        "grad_norm": out["grad_norm"],
        "lr": lr,
        "tokens": int(out["tokens"]),
        "tokens_per_s": tokens_per_s,
        "step_time_s": seconds,
        "peak_mem_mb": out["peak_mem_mb"],
        "mfu": mfu,
        "elapsed_s": run.elapsed_s,
        "skipped_steps": run.skipped_steps,
    }


def _val_due(run: Run, step: int) -> bool:
    every = run.cfg.log.val_every
    return step == run.cfg.steps or (every > 0 and step % every == 0)


def _plots(run: Run) -> None:
    """Redraw loss.png and memory.png (rank 0); the outcome goes to ``run.plots_note``."""
    if run.log is None:
        return
    kind = "max allocated, GPU" if run.env.device.type == "cuda" else "peak RSS, CPU"
    note = write_plots(
        run.log.rows,
        run.out,
        title=f"{run.cfg.model.preset} GPT, {run.env.world} ranks",
        memory_kind=kind,
    )
    if note and note != run.plots_note:  # once per reason, not at every log.plot_every
        run.say(f"plots not written (loss.png, memory.png): {note}")
    run.plots_note = note


def train_loop(run: Run, save: Any) -> None:
    """Steps ``run.step + 1 .. cfg.steps``; ``save(run)`` writes a checkpoint when due."""
    cfg = run.cfg
    for step in range(run.step + 1, cfg.steps + 1):
        lr = run.scheduler.get_last_lr()[0]
        t0 = time.perf_counter()
        batches = [
            to_batch(run.corpus.train, mb, cfg.data, run.env.device, _pad(run))
            for mb in next(run.stream)
        ]
        out = (train_step if run.pipe is None else pipeline_train_step)(run, batches)
        seconds = time.perf_counter() - t0
        run.step, run.tokens_seen = step, run.tokens_seen + int(out["tokens"])
        run.skipped_steps += int(out["skipped"])
        run.elapsed_s += seconds
        row = _row(run, step, lr, out, seconds)
        if _val_due(run, step):
            row["val_loss"] = evaluate(run)
        run.last = row
        if run.log is not None:
            run.log.record(row)
            if cfg.log.plot_every and step % cfg.log.plot_every == 0:
                _plots(run)
        if run.ckpt is not None and run.ckpt.due(step, cfg.steps):
            save(run)
    if run.log is not None:
        run.log.end_progress()
    _plots(run)
