"""One worker's whole session: join the job, build the run, resume, train, report, leave.

:func:`worker_main` is the function every worker process runs, however it was started (the
local elastic launcher, torchrun, srun).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from flatshard.comm.shutdown import end_process_group
from flatshard.models.context_parallel import context_parallel_of
from flatshard.tools.train import cp_plan, hf_model, pipeline
from flatshard.tools.train.build import Env, build_training, flops_per_token, init_distributed
from flatshard.tools.train.checkpointing import (
    CheckpointManager,
    refuse_to_mix,
    rng_state,
    set_rng_state,
)
from flatshard.tools.train.config import TrainConfig
from flatshard.tools.train.config_io import to_dict, to_toml
from flatshard.tools.train.data import endless, load_corpus, make_sampler, validation_steps
from flatshard.tools.train.hf_export import export_hf
from flatshard.tools.train.job_layout import check_layout
from flatshard.tools.train.launcher import LOCAL_LAUNCH_ENV
from flatshard.tools.train.metrics import MetricsLog, peak_flops, read_metrics
from flatshard.tools.train.resolve import gpt_config, moe_config, resolve
from flatshard.tools.train.trainer import Run, sample_text, train_loop

__all__ = ["worker_main"]

USER_ERRORS = (ValueError, TypeError, FileNotFoundError, ImportError, FloatingPointError)
"""Mistakes in the config, the data or the installation, and a non-finite loss under
``optim.nonfinite = "error"``: reported as one line, no traceback."""


def _on_rank0(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on rank 0, its result (or exception) broadcast to every rank: decisions that
    read the file system must be the same everywhere, and an error must stop every rank."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:  # world: a tool
        try:
            box[0] = fn(*args)
        except Exception as e:
            box[0] = e
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        box[0].reported_by_rank0 = dist.get_rank() != 0  # type: ignore[attr-defined]  # world: a tool
        raise box[0]
    return box[0]


def _start_point(cfg: TrainConfig, ckpt: CheckpointManager | None, resume: bool) -> str | None:
    """The checkpoint to resume from (rank 0 decides); refuses to mix a new run into old ones."""
    if ckpt is None:
        if resume:
            raise ValueError(
                "--resume needs checkpoints, but checkpoint.enabled=false; enable them"
            )
        return None
    if not resume:
        refuse_to_mix(ckpt.directory)
        return None
    latest = ckpt.latest()
    return str(latest) if latest is not None else None


def setup(cfg: TrainConfig, env: Env, resume: bool) -> tuple[Run, str | None]:
    """Build the run on this worker; returns it and the checkpoint to resume from."""
    check_layout(cfg, env.world, env.device.type)
    corpus = load_corpus(cfg.data, hf_model.tokenizer_for(cfg.model.hf))
    model, optimizer, scheduler, pipe = build_training(cfg, env, corpus.tokenizer.vocab_size)
    # the data-parallel rank: every tp rank of a group reads the same batches
    sampler = make_sampler(
        corpus.train, cfg.data, rank=env.dp_rank, world=env.dp_world, seed=cfg.seed, train=True
    )
    ckpt = None
    if cfg.checkpoint.enabled:
        ckpt = CheckpointManager(
            Path(cfg.out) / "checkpoints",
            every=cfg.checkpoint.every,
            keep=cfg.checkpoint.keep,
            async_save=cfg.checkpoint.async_save,
            rank=env.rank,
        )
    start = _on_rank0(_start_point, cfg, ckpt, resume)
    run = Run(
        cfg=cfg, env=env, model=model, optimizer=optimizer,
        scheduler=scheduler,
        corpus=corpus, sampler=sampler, pipe=pipe,
        stream=None, val_steps=validation_steps(corpus.val, cfg.data, rank=env.dp_rank,
                                                world=env.dp_world, count=cfg.log.val_batches),
        ckpt=ckpt, log=None,
        flops_per_token=flops_per_token(cfg, model, corpus.attention_length),
        peak_flops=peak_flops(env.device),
        cp=context_parallel_of(model) if env.cp > 1 else None,
    )  # fmt: skip
    return run, start


def _checkpoint_parts(run: Run) -> dict[str, Any]:
    """``fs.save``/``fs.load``'s model and optimizer: with pp > 1 the lists of this rank's
    stages and their optimizers, written as one checkpoint of the whole model across pp."""
    if run.pipe is None:
        return {"model": run.model, "optimizer": run.optimizer}
    pipe = run.pipe
    return {"model": pipe.stages, "optimizer": pipe.optimizers, "across": pipe.mesh["pp"]}


def _save(run: Run) -> None:
    """Checkpoint the run (collective); ``extra`` carries everything but the tensors."""
    states: list[Any] = [None] * run.env.world
    dist.all_gather_object(states, rng_state(run.env.device))
    extra = {
        "step": run.step,
        "sampler": run.sampler.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "rng": {"world_size": run.env.world, "states": states},
        "tokens_seen": run.tokens_seen,
        "elapsed_s": run.elapsed_s,
        "skipped_steps": run.skipped_steps,
        "config": to_dict(run.cfg),
    }
    try:
        path = run.ckpt.save(run.step, extra=extra, **_checkpoint_parts(run))
    except NotImplementedError as e:  # e.g. per-unit (expert) meshes, not yet checkpointable
        raise ValueError(
            f"this run cannot be checkpointed yet ({e}); pass --checkpoint.enabled false"
        ) from None
    run.say(f"checkpoint: {path}")


def _changes(saved: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[str]:
    """``key: old -> new`` for settings that differ (run length and output excluded)."""
    skip = {"steps", "out", "log", "checkpoint", "parallel"}
    out = []
    for key, value in now.items():
        if prefix == "" and key in skip:
            continue
        old = saved.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            out += _changes(old, value, f"{prefix}{key}.")
        elif old != value:
            out.append(f"{prefix}{key}: {old!r} -> {value!r}")
    return out


def restore(run: Run, path: Path) -> None:
    """Continue from the checkpoint at ``path``: tensors, data position, schedule, RNG, curve."""
    extra = run.ckpt.load(path, **_checkpoint_parts(run))
    pairs = (
        zip(run.pipe.optimizers, run.pipe.schedulers, strict=True)
        if run.pipe
        else [(run.optimizer, run.scheduler)]
    )
    for optimizer, scheduler in pairs:
        scheduler.load_state_dict(extra["scheduler"])
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
            group["lr"] = lr  # whatever the optimizer state held: the schedule is the authority
    changes = _changes(extra.get("config", {}), to_dict(run.cfg))
    try:
        run.sampler.load_state_dict(extra["sampler"])  # ValueError if the data set changed
    except ValueError as e:
        raise ValueError(
            f"{e} (settings changed since the checkpoint: {'; '.join(changes) or 'none'})"
        ) from None
    rng = extra["rng"]
    if rng["world_size"] == run.env.world:
        set_rng_state(rng["states"][run.env.rank], run.env.device)
    else:  # a new world size: fresh, still deterministic, per-rank streams
        torch.manual_seed(run.cfg.seed * 1_000_003 + 1 + run.env.rank + 7919 * extra["step"])
    run.step, run.tokens_seen = int(extra["step"]), int(extra["tokens_seen"])
    run.elapsed_s = float(extra["elapsed_s"])
    run.skipped_steps = int(extra.get("skipped_steps", 0))
    if run.env.rank == 0:  # before the metrics log exists: plain prints
        print(
            f"  resumed from {path} at step {run.step} (epoch {run.sampler.epoch}, "
            f"{run.sampler.bins_consumed} bins in)",
            flush=True,
        )
        for change in changes:
            print(f"  note: setting changed since the checkpoint: {change}", flush=True)


def _header(run: Run) -> str:
    cfg, env, corpus = run.cfg, run.env, run.corpus
    d = cfg.data
    tokens = env.dp_world * d.micro_batches * d.rows * d.seq_len
    tp = f" (dp {env.dp_world} x tp {env.tp})" if env.tp > 1 else ""
    if env.cp > 1:
        attention = cp_plan.resolve_cp_attention(cfg, env.device.type)
        tp = f" (dp {env.dp_world} x cp {env.cp}, head-tail split rows, {attention} attention)"
    if env.pp > 1:
        with_tp = f" x tp {env.tp}" if env.tp > 1 else ""
        tp = (f" (pp {env.pp} x dp {env.dp_world}{with_tp}, {cfg.parallel.schedule}, "
              f"{pipeline.microbatch_count(cfg)} microbatches)")  # fmt: skip
    return "\n".join([
        f"flatshard train: {env.world} rank(s){tp}, {cfg.parallel.backend} on "
        f"{env.device.type}, {cfg.parallel.strategy}, {cfg.precision.param_dtype}",
        f"  model: {_model_name(run)}, {_num_params(run):,} parameters",
        f"  data: {corpus.source}, {_tokens_of(corpus)}: {len(corpus.train):,} training pieces, "
        f"{len(corpus.val):,} validation; {'packed' if d.packing else 'padded'} rows of "
        f"{d.seq_len} tokens, {tokens:,} token slots per step",
        f"  out: {cfg.out}",
    ])  # fmt: skip


def _num_params(run: Run) -> int:
    if run.pipe is not None:  # the whole model's count (an HFStage holds it)
        return getattr(run.pipe.stages[0], "whole_params", 0) or gpt_config(run.cfg).num_params()
    if run.cfg.model.experts:
        return moe_config(run.cfg).num_params()
    return hf_model.num_params(run.model)


def _tokens_of(corpus) -> str:
    return getattr(corpus.tokenizer, "name", "byte tokens")


def _model_name(run: Run) -> str:
    if run.cfg.model.hf:
        name = run.pipe.stages[0].arch if run.pipe is not None else type(run.model).__name__
        return f"{name} from {run.cfg.model.hf}"
    if run.cfg.model.experts:
        m = run.cfg.model
        ep = f", ep {run.cfg.parallel.ep}" if run.cfg.parallel.ep > 1 else ""
        return f"{m.preset} MoE GPT ({m.experts} experts, top-{m.top_k}{ep})"
    return f"{run.cfg.model.preset} GPT"


def _open_log(run: Run, first_step: int) -> MetricsLog:
    """Rank 0's metrics sink; a resumed run keeps its curve up to the checkpoint's step."""
    cfg = run.cfg
    history = read_metrics(run.out / "metrics.jsonl", upto=first_step) if first_step else []
    return MetricsLog(
        run.out,
        first_step=first_step,
        total_steps=cfg.steps,
        log_every=cfg.log.every,
        progress_bar=cfg.log.progress_bar,
        tensorboard=cfg.log.tensorboard,
        history=history,
    )


def _finish(run: Run) -> dict[str, Any] | None:
    """Sample, report, and rank 0's summary (None on the other ranks)."""
    text = sample_text(run) if run.cfg.log.sample_tokens else ""
    if run.ckpt is not None:
        run.ckpt.wait()
    if run.cfg.model.hf:  # the final weights as a from_pretrained directory (collective)
        export_hf(run)
    if run.log is None:
        return None
    rows = run.log.rows
    first, last = rows[0], rows[-1]
    run.say(
        f"done: step {last['step']} in {run.elapsed_s:.0f}s of training; loss "
        f"{first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f}"
        + (f"; val_loss {last['val_loss']:.4f}" if last.get("val_loss") is not None else "")
    )
    if text:
        run.say(f"sample: {text!r}")
    run.say(_outputs_line(run))
    return {
        "steps": last["step"],
        "losses": [r["loss"] for r in rows],
        "val_loss": last.get("val_loss"),
        "sample": text,
    }


def _outputs_line(run: Run) -> str:
    """What this run wrote to OUT, and which plots it could not draw and why."""
    plotted = run.plots_note == ""
    files = ["metrics.jsonl", *(["loss.png", "memory.png"] if plotted else []), "config.toml"]
    if run.ckpt is not None:
        files.append("checkpoints/")
    if run.cfg.model.hf:
        files.append("hf/ (from_pretrained)")
    line = f"wrote {run.out}/{', '.join(files)}"
    if not plotted:
        line += f"; no loss.png, memory.png: {run.plots_note or 'not drawn'}"
    return line


def run_worker(cfg: TrainConfig, env: Env, resume: bool) -> dict[str, Any] | None:
    """Set up, maybe resume, train to ``cfg.steps``, finish. Returns rank 0's summary."""
    run, start = setup(cfg, env, resume)
    if env.rank == 0:
        run.out.mkdir(parents=True, exist_ok=True)
        (run.out / "config.toml").write_text(
            to_toml(
                cfg,
                header=(
                    f"flatshard train config (resolved), {time.strftime('%Y-%m-%d %H:%M')}.\n"
                    f"Reproduce with: flatshard train --config {run.out / 'config.toml'}"
                ),
            )
        )
        print(_header(run), flush=True)
        if restart_count():
            print(f"  restart {restart_count()} after a failure: resuming", flush=True)
    if start is not None:
        restore(run, Path(start))  # collective: every rank loads
    elif resume and env.rank == 0:
        print("  resume: no checkpoint yet, starting from step 0", flush=True)
    if env.rank == 0:
        run.log = _open_log(run, run.step)
    run.stream = endless(run.sampler)
    try:
        if run.step >= cfg.steps:
            run.say(f"nothing to do: already at step {run.step} (steps={cfg.steps})")
            return None
        train_loop(run, _save)
        return _finish(run)
    finally:
        if run.log is not None:
            run.log.close()


def _local_env_config(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` resolved for this machine, before the process group exists."""
    backend = cfg.parallel.backend
    cuda = torch.cuda.is_available() and backend != "gloo"
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return resolve(cfg, cuda=cuda, local_world=local_world)


def _report(e: BaseException, rank: str, user_error: bool) -> None:
    """Record the error for the launcher (torch elastic's error file) and print it, unless our
    own local launcher will print it once for all ranks."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        get_error_handler().record_exception(e)  # must run inside the except block
    if os.environ.get(LOCAL_LAUNCH_ENV) == "1":
        return
    if user_error:
        if not getattr(e, "reported_by_rank0", False):  # rank 0's broadcast error: print once
            print(f"[rank {rank}] error: {e}", file=sys.stderr, flush=True)
    else:
        print(f"[rank {rank}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)


def restart_count() -> int:
    """How many times the launcher (ours, or torchrun ``--max-restarts``) restarted the workers."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _on_any_rank(flag: bool) -> bool:
    """True everywhere if true on any rank. torchrun counts a restart only on the node whose
    worker failed; the other nodes' agents restart theirs for the "membership change" with
    ``TORCHELASTIC_RESTART_COUNT`` unchanged (seen: 1 on one node, 0 on the other), and rank 0,
    which decides whether to resume, may be on either."""
    flags: list[Any] = [None] * dist.get_world_size()  # world: a tool
    dist.all_gather_object(flags, flag)
    return any(flags)


def worker_main(cfg: TrainConfig, resume: bool) -> dict[str, Any] | None:
    """Entry point of every worker process. A user error (bad config, data or checkpoint)
    exits with status 2 and its one-line message; anything else with 1 and its traceback.
    A restarted worker (after a failure) resumes from the newest checkpoint, as with --resume."""
    rank = "?"
    resume = resume or restart_count() > 0
    try:
        cfg = _local_env_config(cfg)
        p = cfg.parallel
        env = init_distributed(p.backend, p.timeout_s, p.tp, p.pp, p.cp)
        rank = str(env.rank)
        try:
            return run_worker(cfg, env, _on_any_rank(resume))
        finally:
            end_process_group()  # see [Note: the exit abort]
    except USER_ERRORS as e:
        _report(e, rank, user_error=True)
        raise SystemExit(2) from None
    except Exception as e:
        _report(e, rank, user_error=False)
        raise SystemExit(1) from None
