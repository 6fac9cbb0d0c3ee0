"""Train the reference tiny GPT with flatshard on the embedded corpus, with sequence packing.

The "main job" until ``flatshard train`` lands; on two local CPU ranks (Gloo)::

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/train_tiny_gpt.py [--steps N] [--out DIR]

Every rank builds the same model from the same seed and ``fs.shard`` keeps 1/world of it per rank.
The sampler gives every rank the same number of micro-batches per step, so the collectives of
forward/backward stay in lockstep; the loss is normalised over the step's *global* target tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

import flatshard as fs
from flatshard.data import ByteTokenizer, embedded_documents, train_val_split
from flatshard.models import GPT, Block, GPTConfig
from flatshard.packing import (
    PackedBatch,
    PackedBatchSampler,
    collate,
    global_token_count,
    packed_cross_entropy,
    split_long_documents,
)

TOK = ByteTokenizer()
Docs = list[list[int]]  # token-id documents (or chunks of them)


@dataclass(frozen=True)
class Dist:
    """Where this process runs: its rank, the world size and its compute device."""

    rank: int
    world: int
    device: torch.device


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per packed row (<= 256)")
    p.add_argument("--rows", type=int, default=4, help="packed rows per rank per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=20, help="linear warm-up steps")
    p.add_argument("--out", type=Path, default=None, help="write DIR/metrics.jsonl (rank 0)")
    p.add_argument("--seed", type=int, default=0, help="model init and data order seed")
    p.add_argument("--log-every", type=int, default=10, help="print every N steps")
    return p.parse_args()


def init_distributed() -> Dist:
    """Join torchrun's process group: NCCL on one GPU per rank if CUDA exists, else Gloo."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), device)


def tokenized_chunks(docs: list[str], seq_len: int) -> Docs:
    """Byte tokens (+ eos) of every document, long ones cut into pieces of at most seq_len."""
    encoded = TOK.encode_documents(docs)
    chunks = split_long_documents([len(d) for d in encoded], seq_len)
    return [encoded[c.doc][c.start : c.end] for c in chunks]


def build_model(device: torch.device) -> GPT:
    """The tiny GPT, identical on every rank (seeded by the caller), sharded by Block."""
    with device:
        model = GPT(GPTConfig.preset("tiny"))
    return fs.shard(model, policy=fs.wrap.by_type(Block))


def build_optimizer(model: GPT, lr: float, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """AdamW; norms and biases skip weight decay. After sharding every parameter is a 1-D
    fragment, so ``p.ndim`` cannot tell a matrix from a norm: decide by the (preserved) name."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if "norm" in name or name.endswith("bias") else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def warmup_cosine(warmup: int, total: int, floor: float = 0.1) -> Callable[[int], float]:
    """LR multiplier: linear warm-up to 1, then cosine decay to ``floor`` at ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def make_sampler(
    chunks: Docs, args: argparse.Namespace, d: Dist, shuffle: bool
) -> PackedBatchSampler:
    """Packs ``chunks`` into bins of ``--seq-len`` tokens; each step gives every rank one
    micro-batch of ``--rows`` bins (collate it with ``rows=--rows``)."""
    lengths = [len(c) for c in chunks]
    kw = {"rank": d.rank, "world_size": d.world, "seed": args.seed, "shuffle": shuffle}
    return PackedBatchSampler(lengths, args.seq_len, bins_per_micro_batch=args.rows, **kw)


def to_batch(chunks: Docs, indices: list[int], args: argparse.Namespace, d: Dist) -> PackedBatch:
    """One fixed-shape packed micro-batch ``[rows, seq_len]`` (all padding if ``indices`` is [])."""
    docs = [chunks[i] for i in indices]
    return collate(docs, args.seq_len, pad_id=TOK.pad_id, rows=args.rows).to(d.device)


def endless(sampler: PackedBatchSampler) -> Iterator[list[list[int]]]:
    """This rank's micro-batches step after step, epoch after epoch."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from sampler
        epoch += 1


def train_step(
    model: GPT, opt: torch.optim.Optimizer, sched: LambdaLR, batches: list[PackedBatch], d: Dist
) -> dict[str, float]:
    """One optimizer step over this rank's micro-batches; returns global loss, tokens, norm."""
    targets = global_token_count([b.labels for b in batches])  # all ranks, all micro-batches
    loss_sum, real_tokens = 0.0, 0
    for b in batches:  # the same count on every rank (the sampler guarantees it)
        logits = model(b.input_ids, b.position_ids, b.cu_seqlens, b.max_seqlen)  # [R, T, V]
        loss = packed_cross_entropy(logits, b.labels, targets, world_size=d.world)
        loss.backward()
        loss_sum += loss.item()
        real_tokens += int((b.input_ids != TOK.pad_id).sum())
    grad_norm = fs.clip_grad_norm_(model, max_norm=1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    # Rank r's loss is W * (its token-loss sum) / G, so the global mean is (sum over ranks) / W.
    stats = torch.tensor([loss_sum, float(real_tokens)], device=d.device)
    dist.all_reduce(stats)
    loss_mean, tokens = stats[0].item() / d.world, stats[1].item()
    return {"loss": loss_mean, "tokens": tokens, "grad_norm": grad_norm.item()}


@torch.no_grad()
def evaluate(model: GPT, chunks: Docs, args: argparse.Namespace, d: Dist) -> float:
    """Mean token loss over the whole (small) validation split, in lockstep on all ranks."""
    totals = torch.zeros(2, device=d.device)  # [token-loss sum, target count]
    for step in make_sampler(chunks, args, d, shuffle=False):
        for indices in step:
            b = to_batch(chunks, indices, args, d)
            logits = model(b.input_ids, b.position_ids, b.cu_seqlens, b.max_seqlen)
            totals[0] += GPT.loss(logits, b.labels, reduction="sum")
            totals[1] += b.num_targets
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def sample_text(model: GPT, prompt: str, device: torch.device, seed: int, n: int = 200) -> str:
    """Top-k sample. Every forward of the sharded model all-gathers, so *every* rank generates,
    with the same prompt and seed (identical results); no eos stop, so all run n forwards."""
    ids = torch.tensor(TOK.encode(prompt, add_eos=False), device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(ids, n, temperature=0.8, top_k=20, generator=gen).tolist()
    if TOK.eos_id in out[len(ids) :]:  # cut at the first end-of-document
        out = out[: out.index(TOK.eos_id, len(ids))]
    return TOK.decode(out)


def train(
    model: GPT, chunks: Docs, args: argparse.Namespace, d: Dist, metrics: IO[str] | None
) -> None:
    """The training loop: rank 0 prints every ``--log-every`` steps and writes every step."""
    opt = build_optimizer(model, args.lr)
    sched = LambdaLR(opt, warmup_cosine(args.warmup, args.steps))
    steps = endless(make_sampler(chunks, args, d, shuffle=True))
    for step in range(1, args.steps + 1):
        lr = sched.get_last_lr()[0]
        t0 = time.perf_counter()
        batches = [to_batch(chunks, indices, args, d) for indices in next(steps)]
        out = train_step(model, opt, sched, batches, d)
        tokens_per_s = out["tokens"] / (time.perf_counter() - t0)
        row = {"step": step, "loss": out["loss"], "tokens_per_s": tokens_per_s}
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
        row.update(peak_mem_mb=peak_mb, lr=lr, grad_norm=out["grad_norm"])
        if metrics is not None:
            metrics.write(json.dumps(row) + "\n")
        if d.rank == 0 and (step % args.log_every == 0 or step in (1, args.steps)):
            print(
                "step {step:4d} | loss {loss:.4f} | grad norm {grad_norm:.3f} | lr {lr:.2e} | "
                "{tokens_per_s:,.0f} tok/s | peak RSS {peak_mem_mb:.0f} MB".format(**row),
                flush=True,
            )


def main() -> None:
    args = parse_args()
    d = init_distributed()
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    train_docs, val_docs = train_val_split(embedded_documents())
    train_chunks = tokenized_chunks(train_docs, args.seq_len)
    val_chunks = tokenized_chunks(val_docs, args.seq_len)
    model = build_model(d.device)
    metrics = None
    if d.rank == 0:
        print(f"world={d.world} device={d.device} params={model.num_params():,}", flush=True)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            metrics = (args.out / "metrics.jsonl").open("w")
    start = time.perf_counter()
    train(model, train_chunks, args, d, metrics)
    if metrics is not None:
        metrics.close()
    val_loss = evaluate(model, val_chunks, args, d)
    text = sample_text(model, "Return the ", d.device, args.seed)
    if d.rank == 0:
        print(f"trained in {time.perf_counter() - start:.1f}s | val loss {val_loss:.4f}")
        print(f"sample: {text!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
