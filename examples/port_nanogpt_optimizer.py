"""Port nanoGPT's ``configure_optimizers`` to a sharded model: one line changes.

    python examples/port_nanogpt_optimizer.py          # 2 CPU ranks (Gloo), spawned here
    torchrun --nproc-per-node 2 examples/port_nanogpt_optimizer.py

nanoGPT decays every parameter with two or more dimensions and no others, written as
``p.dim() >= 2``. After ``fs.shard`` every parameter is a 1-D fragment of this rank's shard, so
that test finds no matrix at all (flatshard refuses such an optimizer at its first step with
a ``ValueError`` naming the fix). The port asks for the *original* shape instead:

    before:  decay = [p for n, p in params.items() if p.dim() >= 2]
    after:   decay = [p for n, p in params.items() if len(fs.full_shape(p)) >= 2]

or, in one call, ``fs.optim.param_groups(model, weight_decay, decay_embeddings=True)``
(nanoGPT's rule; the default also exempts embeddings, as the HF Trainer and most recipes do).
The script builds both, checks that they agree with the unsharded model's grouping, and takes
a few AdamW steps with clipping by ``fs.clip_grad_norm_`` (torch's clips by this rank's norm).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flatshard as fs
from flatshard.comm.shutdown import end_process_group
from flatshard.models import GPT, GPTConfig


def configure_optimizers(model, weight_decay: float, lr: float) -> torch.optim.AdamW:
    """nanoGPT's grouping, ported: the full shape decides, not the fragment's."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    decay = [p for p in params.values() if len(fs.full_shape(p)) >= 2]
    no_decay = [p for p in params.values() if len(fs.full_shape(p)) < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def worker() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, max_seq_len=64, d_model=64, n_layers=2, n_heads=4)
    plain = GPT(cfg)
    unsharded_decay = sum(1 for p in plain.parameters() if p.dim() >= 2)
    model = fs.shard(GPT(cfg))
    opt = configure_optimizers(model, weight_decay=0.1, lr=1e-3)
    helper = fs.optim.param_groups(model, 0.1, decay_embeddings=True)
    assert len(opt.param_groups[0]["params"]) == unsharded_decay == len(helper[0]["params"])
    for step in range(3):
        tokens = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len + 1))
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        norm = fs.clip_grad_norm_(model.parameters(), 1.0)  # global norm, like torch's signature
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.3f}, grad norm {norm.item():.3f}")
    if dist.get_rank() == 0:
        print(f"{unsharded_decay} matrices decayed, as on the unsharded model")
    # dist.destroy_process_group(), plus a pause that lets torch 2.13's Gloo threads finish
    # before the interpreter exits (they can abort it otherwise: docs/reliability.md, section 8)
    end_process_group()


def _spawned(rank: int, world: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    worker()


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun
        worker()
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        mp.spawn(_spawned, args=(2,), nprocs=2)
