"""Forward-only passes through the pipeline stages: validation and the final text sample.

Torch's ``schedule.eval`` runs the V-shaped schedules' backward actions too (``ZBVZeroBubble``
fails: "can't steal_bwd_input if this stage doesn't have backward", torch 2.13), and any
schedule pins the microbatch shape its first step inferred. Evaluation needs neither: one
microbatch walks the stages in order, each owner computing its stage and handing the hidden
state ``[B, T, d_model]`` (``T / tp`` tokens per tp rank under tp) to the next stage's owner
by point-to-point send on the pp group (the stages' outputs are fp32: the trainer's mixed
precision sets ``output_dtype``). Any shape works, so validation uses the trainer's
validation micro-batches as they are, and sampling one growing context (padded on the right
to a multiple of tp: causal attention, the padding changes nothing before it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from flatshard.models import GPT
from flatshard.tools.train.data import to_batch
from flatshard.tools.train.pipeline import stage_indices, stages_per_rank

Run = Any  # the trainer's Run, not imported: trainer.py imports this module

__all__ = ["forward_through", "pipeline_evaluate", "pipeline_generate"]


def _owners(run: Run) -> list[int]:
    """The pp rank holding each stage, in stage order."""
    cfg, pp = run.cfg, run.env.pp
    v = stages_per_rank(cfg)
    owner = [0] * (pp * v)
    for r in range(pp):
        for s in stage_indices(r, pp, v, cfg.parallel.schedule):
            owner[s] = r
    return owner


def forward_through(run: Run, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
    """Logits ``[B, T, V]`` of ``ids [B, T]`` on the ranks holding the last stage, None on the
    others (every rank of the job calls it, with the same shapes in its dp column)."""
    pipe, env = run.pipe, run.env
    owners, me = _owners(run), pipe.mesh["pp"].get_local_rank()
    group = pipe.mesh["pp"].get_group()
    mine = iter(pipe.stages)  # this rank's stage modules, in stage order
    x: torch.Tensor = ids
    width = pipe.stages[0].width  # a GPTStage's or an HFStage's (pipeline_hf) hidden width
    rows, length = ids.shape[0], ids.shape[1] // env.tp  # sequence parallel: T / tp per rank
    for s, owner in enumerate(owners):
        if owner != me:
            continue
        if s > 0 and owners[s - 1] != me:
            x = torch.empty(rows, length, width, device=env.device)  # [B, T / tp, C] fp32
            dist.recv(x, group=group, group_src=owners[s - 1])
        x = next(mine)(x, positions)
        if s < len(owners) - 1 and owners[s + 1] != me:
            dist.send(x.float().contiguous(), group=group, group_dst=owners[s + 1])
    return x if pipe.last else None


@torch.no_grad()
def pipeline_evaluate(run: Run) -> float | None:
    """Mean token loss over the validation micro-batches, forward only."""
    if not run.val_steps:
        return None
    pipe, device = run.pipe, run.env.device
    for module in pipe.stages:
        module.eval()
    totals = torch.zeros(2, device=device)  # [token-loss sum, target count]
    for indices in run.val_steps:  # the same count on every rank
        b = to_batch(run.corpus.val, indices, run.cfg.data, device, run.corpus.tokenizer.pad_id)
        logits = forward_through(run, b.input_ids, b.position_ids)
        if logits is not None:  # one rank per dp column adds
            totals[0] += GPT.loss(logits, b.labels, reduction="sum")
            totals[1] += b.num_targets
    for module in pipe.stages:
        module.train()
    dist.all_reduce(totals)
    return (totals[0] / totals[1].clamp(min=1)).item()


@torch.no_grad()
def pipeline_generate(run: Run, ids: torch.Tensor, tokens: int, gen: torch.Generator):
    """The final sample (top-20 at temperature 0.8, as unpipelined): the last stage's owner
    samples each token and broadcasts it over its pp group."""
    from flatshard.models.sampling import generate as sample

    pipe = run.pipe
    group = pipe.mesh["pp"].get_group()
    source, tp = _owners(run)[-1], run.env.tp
    limit = run.cfg.data.seq_len - run.cfg.data.seq_len % tp  # the RoPE tables' length

    def logits(context: torch.Tensor) -> torch.Tensor | None:  # [1, T] -> [1, T, V]
        length = context.shape[1]
        pad = -length % tp  # sequence parallelism: pad on the right (causal: changes nothing)
        if pad:
            context = torch.cat([context, context[:, -1:].expand(-1, pad)], dim=1)
        positions = torch.arange(context.shape[1], device=context.device).unsqueeze(0)
        out = forward_through(run, context, positions)
        return None if out is None else out[:, :length]

    out = ids
    for _ in range(tokens):
        nxt = torch.zeros(1, dtype=torch.long, device=ids.device)
        scores = logits(out[None, -limit:])
        if scores is not None:
            nxt = sample(lambda _ids, s=scores: s, out[None, -limit:], 1, max_seq_len=limit,
                         temperature=0.8, top_k=20, generator=gen)[0, -1:]  # fmt: skip
        dist.broadcast(nxt, group=group, group_src=source)
        out = torch.cat([out, nxt])
    return out
