"""Pipeline parallelism with flatshard stages: pp 2 x dp 2 on 4 CPU ranks (Gloo).

    torchrun --nproc-per-node 4 examples/pipeline.py [--schedule 1F1B] [--steps 30]

A small model (embedding, blocks, norm + head) is cut into two stages. Every rank builds the
2-D mesh (pp, dp), keeps the stage of its pp coordinate, shards it over its dp mesh with
``fs.shard``, wraps it in a ``PipelineStage`` and trains it with a
``torch.distributed.pipelining`` schedule (GPipe or 1F1B), each step inside
``fs.pipeline_step(schedule)`` (gradients kept over the microbatches, reduced once when the
step ends). The schedule's ``loss_fn`` is the mean over one microbatch; the schedule divides
the gradients by the number of microbatches (``scale_grads=True``) and flatshard averages
them over dp, so each step optimises the mean loss of the global batch. The last stage
prints the loss (averaged over dp). See docs/parallelism.md.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import flatshard as fs
from flatshard.comm.shutdown import end_process_group

SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}
VOCAB, DIM, SEQ = 32, 64, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Stage(nn.Module):
    """A slice of the model: the embedding on the first stage, norm + head on the last."""

    def __init__(self, first: bool, last: bool, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM) if first else None
        self.blocks = nn.Sequential(*[Block() for _ in range(blocks)])
        self.norm = nn.LayerNorm(DIM) if last else None
        self.head = nn.Linear(DIM, VOCAB) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        x = self.blocks(x)
        return self.head(self.norm(x)) if self.head is not None else x


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and their successors (the task: predict ``x + 1 mod VOCAB``)."""
    x = torch.randint(VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(step))
    return x, (x + 1) % VOCAB


def train(schedule_name: str, steps: int, microbatches: int, rows: int) -> list[float]:
    """Train on an initialised 4-rank process group; the losses (averaged over dp) on the
    last stage's ranks, [] on the others."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))  # every rank, same order
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    torch.manual_seed(0)  # the same stage on both dp ranks
    stages = [Stage(first=True, last=False, blocks=2), Stage(first=False, last=True, blocks=2)]
    stage = stages[pp]
    fs.shard(stage, policy=fs.wrap.by_type(Block), mesh=mesh["dp"])
    pipe = PipelineStage(stage, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = SCHEDULES[schedule_name](pipe, n_microbatches=microbatches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(stage.parameters(), lr=3e-3)
    out = []
    for step in range(steps):
        x, y = batch(step, 2 * microbatches * rows)  # the global batch; this dp rank: its half
        x, y = x.chunk(2)[dp], y.chunk(2)[dp]
        losses: list[torch.Tensor] = []
        with fs.pipeline_step(schedule):  # gradients reduced once per step, when it ends
            if pp == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=losses)
        opt.step()
        opt.zero_grad()
        if pp == 1:
            loss = torch.stack(losses).mean()
            dist.all_reduce(loss, group=mesh["dp"].get_group())  # the sum over dp
            out.append(loss.item() / 2)
            if dp == 0:
                print(f"step {step:3d}  loss {out[-1]:.4f}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default="GPipe")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--rows", type=int, default=4, help="rows per microbatch")
    args = p.parse_args()
    if os.environ.get("WORLD_SIZE") != "4":
        raise SystemExit("run it as: torchrun --nproc-per-node 4 examples/pipeline.py")
    dist.init_process_group("gloo")
    train(args.schedule, args.steps, args.microbatches, args.rows)
    end_process_group()  # destroy_process_group, then let Gloo's threads finish (a Gloo exit abort)


if __name__ == "__main__":
    main()
