"""Tensor parallel x flatshard (2-D): dp x tp on one DeviceMesh, CPU Gloo (NCCL on CUDA).

    torchrun --nproc-per-node 4 examples/tensor_parallel.py [--dp 2 --tp 2] [--steps 20] \\
        [--loss-parallel] [--dim 128 --layers 2 --seq 64 --batch 4]

Every rank builds the mesh ``(dp, tp)``. flatshard's GPT is made tensor-parallel on
``mesh["tp"]`` first (``parallelize_gpt``: Megatron layout, sequence parallelism on), then
sharded over ``mesh["dp"]`` with ``fs.shard``. The ranks of one tp group are one model
replica: they must see the same batch, so data is split by the *dp* rank, not the global
rank. The task is learnable (predict ``token + 1``), so the loss falls; rank 0 prints the
loss averaged over dp each step. See docs/parallelism.md ("Tensor parallel (2-D)").
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

import flatshard as fs
from flatshard.comm.shutdown import end_process_group
from flatshard.models import GPT, Block, GPTConfig
from flatshard.models.tensor_parallel import parallelize_gpt

VOCAB = 256  # every size the plan splits (heads, d_ff, vocabulary) must divide by tp


def setup() -> str:
    """Initialise the process group: NCCL on this rank's GPU if there is one, else Gloo."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        return "cuda"
    dist.init_process_group("gloo")
    return "cpu"


def build(args: argparse.Namespace, mesh: DeviceMesh, device: str) -> GPT:
    """The GPT, tensor-parallel on ``mesh["tp"]``, then sharded over ``mesh["dp"]``."""
    config = GPTConfig(
        vocab_size=VOCAB, d_model=args.dim, n_layers=args.layers, n_heads=4, max_seq_len=args.seq
    )
    torch.manual_seed(0)  # the same initial model on every rank
    with torch.device(device):
        model = GPT(config)
    parallelize_gpt(model, mesh["tp"], sequence_parallel=True, loss_parallel=args.loss_parallel)
    return fs.shard(model, policy=fs.wrap.by_type(Block), mesh=mesh["dp"])


def batch(
    step: int, args: argparse.Namespace, dp_rank: int, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """This dp rank's rows of the step's global batch (equal on every rank of a tp group)."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(VOCAB, (args.dp * args.batch, args.seq), generator=g)
    mine = ids.chunk(args.dp)[dp_rank].to(device)  # [batch, seq]
    return mine, (mine + 1) % VOCAB  # inputs, targets


def train(args: argparse.Namespace, device: str) -> list[float]:
    """Train on an initialised process group; the losses (averaged over dp), every rank."""
    mesh = init_device_mesh(device, (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_rank, dp_group = mesh["dp"].get_local_rank(), mesh["dp"].get_group()
    model = build(args, mesh, device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)  # after fs.shard
    # Vocabulary-split logits: the loss and its backward run inside loss_parallel().
    context = loss_parallel if args.loss_parallel else contextlib.nullcontext
    losses = []
    for step in range(args.steps):
        ids, labels = batch(step, args, dp_rank, device)
        with context():
            loss = model(ids, labels=labels)  # mean cross-entropy of this dp rank's rows
            loss.backward()
        norm = fs.clip_grad_norm_(model, max_norm=1.0)  # over both axes: dp shards, tp parts
        opt.step()
        opt.zero_grad()
        loss = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
        dist.all_reduce(loss, group=dp_group)  # the sum over dp (tp peers hold the same)
        losses.append(loss.item() / args.dp)
        if dist.get_rank() == 0:
            print(
                f"step {step:3d}  grad norm {norm.item():7.3f}  loss {losses[-1]:.4f}", flush=True
            )
    return losses


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=2, help="data-parallel degree (flatshard)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--loss-parallel", action="store_true", help="keep the logits vocab-split")
    p.add_argument("--dim", type=int, default=128, help="model width (4 heads)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=64, help="tokens per row (a multiple of --tp)")
    p.add_argument("--batch", type=int, default=4, help="rows per dp rank")
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world != args.dp * args.tp:
        p.error(
            f"--dp {args.dp} x --tp {args.tp} needs {args.dp * args.tp} ranks, WORLD_SIZE is "
            f"{world}; run: torchrun --nproc-per-node {args.dp * args.tp} "
            "examples/tensor_parallel.py"
        )
    return args


def main() -> None:
    args = parse_args()
    train(args, setup())
    end_process_group()  # destroy_process_group, then let Gloo's threads finish (a Gloo exit abort)


if __name__ == "__main__":
    main()
