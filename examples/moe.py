"""Mixture of Experts with expert parallelism x flatshard: world 4 = ("efsdp", "ep") = (2, 2).

    torchrun --nproc-per-node 4 examples/moe.py [--steps 20] [--experts 4] [--top-k 2] \\
        [--ep 2] [--dim 64 --layers 2 --seq 32 --batch 4]

Every rank builds the mesh ``(efsdp, ep)``. flatshard's ``MoEGPT`` is built with
``ep_group=mesh["ep"]``: each rank holds ``experts / ep`` experts, and routed tokens travel to
them and back by all-to-all over its ep group. ``fs.shard`` then shards the dense part of every
``MoEBlock`` over all ranks, and (through a policy that returns ``mesh["efsdp"]``) each
``Experts`` module over the ranks that hold the same experts. Every rank is a data-parallel
rank: it trains on its own chunk of the global batch. The task is learnable (predict
``token + 1``), so the loss falls; rank 0 prints the loss averaged over all ranks each step.
See docs/parallelism.md ("Expert parallelism").
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import flatshard as fs
from flatshard.comm.shutdown import end_process_group
from flatshard.models.moe import Experts, MoEBlock, MoEConfig, MoEGPT

VOCAB = 64


def setup() -> str:
    """Initialise the process group: NCCL on this rank's GPU if there is one, else Gloo."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        return "cuda"
    dist.init_process_group("gloo")
    return "cpu"


def expert_policy(mesh: DeviceMesh):
    """The wrap policy: ``Experts`` sharded over ``mesh["efsdp"]`` (the ranks holding the same
    experts), every ``MoEBlock`` a unit over the model's mesh (all ranks), nothing else."""
    efsdp = mesh["efsdp"]

    def policy(module: nn.Module) -> bool | DeviceMesh:
        return efsdp if isinstance(module, Experts) else isinstance(module, MoEBlock)

    return policy


def make_config(args: argparse.Namespace) -> MoEConfig:
    return MoEConfig(
        vocab_size=VOCAB,
        d_model=args.dim,
        n_layers=args.layers,
        n_heads=4,
        max_seq_len=args.seq,
        n_experts=args.experts,
        top_k=args.top_k,
    )


def build(args: argparse.Namespace, mesh: DeviceMesh, device: str) -> MoEGPT:
    """This rank's MoEGPT (its ep rank's experts), sharded."""
    config = make_config(args)
    torch.manual_seed(0)  # the same dense weights on every rank, each expert on its holders
    with torch.device(device):
        model = MoEGPT(config, ep_group=mesh["ep"])
    return fs.shard(model, policy=expert_policy(mesh))  # mesh=None: the model spans all ranks


def batch(
    step: int, args: argparse.Namespace, world: int, rank: int, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows of the step's global batch (every rank its own chunk)."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(VOCAB, (world * args.batch, args.seq), generator=g)
    mine = ids.chunk(world)[rank].to(device)  # [batch, seq]
    return mine, (mine + 1) % VOCAB  # inputs, targets


def train(args: argparse.Namespace, device: str) -> list[float]:
    """Train on an initialised process group; the losses (averaged over ranks), every rank."""
    world = dist.get_world_size()
    mesh = init_device_mesh(device, (world // args.ep, args.ep), mesh_dim_names=("efsdp", "ep"))
    model = build(args, mesh, device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)  # after fs.shard
    losses = []
    for step in range(args.steps):
        ids, labels = batch(step, args, world, dist.get_rank(), device)
        loss = model(ids, labels=labels)  # cross-entropy + aux_loss_coef * load balancing
        loss.backward()
        norm = fs.clip_grad_norm_(model, max_norm=1.0)  # the global norm: dense and experts
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss)  # the sum over all ranks (each trained on its own rows)
        losses.append(loss.item() / world)
        if dist.get_rank() == 0:
            print(
                f"step {step:3d}  grad norm {norm.item():7.3f}  loss {losses[-1]:.4f}", flush=True
            )
    return losses


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--experts", type=int, default=4, help="experts per layer (over all ep ranks)")
    p.add_argument("--top-k", type=int, default=2, help="experts each token is routed to")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel degree (efsdp = world / ep)")
    p.add_argument("--dim", type=int, default=64, help="model width (4 heads)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=32, help="tokens per row")
    p.add_argument("--batch", type=int, default=4, help="rows per rank")
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world < 1 or args.ep < 1 or world % args.ep:
        p.error(
            f"--ep {args.ep} must divide WORLD_SIZE ({world or 'unset'}); run: "
            "torchrun --nproc-per-node 4 examples/moe.py"
        )
    if args.experts % args.ep:
        p.error(f"--experts {args.experts} must be a multiple of --ep {args.ep}")
    if not 1 <= args.top_k <= args.experts:
        p.error(f"--top-k {args.top_k} must be between 1 and --experts {args.experts}")
    return args


def main() -> None:
    args = parse_args()
    train(args, setup())
    end_process_group()  # destroy_process_group, then let Gloo's threads finish (a Gloo exit abort)


if __name__ == "__main__":
    main()
