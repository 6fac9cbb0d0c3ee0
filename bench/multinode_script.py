"""A plain library script for a multi-node launch: a tiny MLP, ``fs.shard`` with hybrid_shard
(shard within a node, replicate across nodes), a few steps of AdamW. Run it under torchrun:

    OMP_NUM_THREADS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 2 \
        --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        bench/multinode_script.py --steps 5

(on this box: two such commands with ``localhost``). Rank 0 prints one JSON line: the world,
the mesh, and the loss of every step, which must equal an unsharded model's on the same global
batch (``--check``). ``init_process_group`` gets :func:`flatshard.comm.attempt_store`'s
arguments, so the script also survives ``torchrun --max-restarts`` without the variable.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import flatshard as fs
from flatshard.comm.attempt_store import attempt_store
from flatshard.comm.shutdown import end_process_group

ROWS = 4  # per rank


def batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (every rank builds all of it and takes its rows)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(world * ROWS, 16, generator=g)
    return x, x.sum(1, keepdim=True).tanh()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--check", action="store_true", help="compare with an unsharded model")
    args = p.parse_args()
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", timeout=timeout, **attempt_store(timeout))
    rank, world = dist.get_rank(), dist.get_world_size()  # world: a tool
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    mesh = init_device_mesh(
        "cpu", (world // per_node, per_node), mesh_dim_names=("replicate", "shard")
    )
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    reference = copy.deepcopy(net)
    model = fs.shard(net, strategy="hybrid_shard", mesh=mesh, policy=fs.wrap.root_only())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses, gaps = [], []
    for step in range(args.steps):
        x, y = batch(step, world)
        mine = slice(rank * ROWS, (rank + 1) * ROWS)
        loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if args.check:  # the same step unsharded, on the whole batch
            ref_loss = torch.nn.functional.mse_loss(reference(x), y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            gaps.append(abs(ref_loss.item() - losses[-1]))
    if rank == 0:
        shape = {"replicate": world // per_node, "shard": per_node}
        print(json.dumps({"world": world, "mesh": shape, "losses": losses, "gaps": gaps}))
    end_process_group()


if __name__ == "__main__":
    main()
