"""``flatshard train --model.experts E [--model.top_k K] [--parallelism.ep N]``: the MoE GPT.

[Note: the trainer's (efsdp, ep) layout]
With ``model.experts = E > 0`` the trainer builds ``flatshard.models.moe.MoEGPT`` (every
block's MLP is ``E`` SwiGLU experts of width ``d_ff``, token-choice top-``K`` routing). With
``parallel.ep = N > 1`` the ranks form a mesh ``("efsdp", "ep")`` of shape ``(world / N, N)``
(the ep peers consecutive): each rank holds ``E / N`` experts per layer, routed tokens travel
to them and back by all-to-all over ``mesh["ep"]``, and each ``Experts`` unit is sharded over
``mesh["efsdp"]`` (the ranks holding the same experts: a per-unit mesh, returned by the wrap
policy); the dense part of every ``MoEBlock`` is sharded over all ranks as usual.

* **Pipeline** (``parallel.pp > 1``): the same layout inside each stage's ``world / pp`` dp
  ranks, mesh ``("pp", "efsdp", "ep")`` (:func:`expert_mesh`); see ``tools/train/pipeline.py``.
* **Data.** Every rank is a data-parallel rank (EP splits the experts, not the batch): the
  sampler is built for ``rank`` of ``world``, as without EP.
* **Loss.** The logged ``loss`` is the token-mean cross-entropy (as for the dense GPT); the
  gradient also carries ``aux_loss_coef`` times the routers' load-balancing loss (its mean
  over this rank's micro-batches, averaged over ranks by the gradient reduction).
* **Checkpoints** of ``ep > 1`` models need ``fs.save`` to accept per-unit meshes; until it
  does, the trainer says so and names ``--checkpoint.enabled false``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import flatshard as fs
from flatshard.tools.train.config import TrainConfig

__all__ = [
    "aux_loss",
    "build_moe_model",
    "check_ep",
    "expert_mesh",
    "is_moe",
    "moe_decoder",
    "unit_policy",
]


def check_ep(cfg: TrainConfig, world: int) -> None:
    """Refuse an expert layout this job cannot run, naming the value and the fix."""
    m, p = cfg.model, cfg.parallel
    if p.ep > 1 and not m.experts:
        raise ValueError(
            f"parallel.ep={p.ep} needs a Mixture-of-Experts model: pass --model.experts E "
            "(a multiple of ep), or --parallelism.ep 1"
        )
    if not m.experts:
        return
    if m.hf:
        raise ValueError(f"model.experts={m.experts} builds flatshard's MoE GPT: drop model.hf")
    if p.tp > 1:
        raise ValueError(
            f"parallel.tp={p.tp} cannot be combined with model.experts yet; pass --parallelism.tp 1"
        )
    if p.strategy == "hybrid_shard":
        raise ValueError(
            "parallel.strategy='hybrid_shard' cannot be combined with model.experts yet; "
            "pass full_shard"
        )
    dp = world // p.pp if world % p.pp == 0 else world  # pp: a stage's data-parallel ranks
    if dp % p.ep or m.experts % p.ep:
        where = f"the world size {world}" if p.pp == 1 else f"the {dp} ranks of each stage"
        raise ValueError(
            f"parallel.ep={p.ep} must divide {where} and model.experts={m.experts}; pass a "
            "--parallelism.ep that divides both"
        )


def is_moe(cfg: TrainConfig) -> bool:
    return cfg.model.experts > 0


def unit_policy(ep_mesh: Any) -> Any:
    """Units: every ``MoEBlock`` over the model's mesh; every ``Experts`` over the ranks that
    hold the same experts (``efsdp``), or as a plain unit without EP."""
    from flatshard.models.moe import Experts, MoEBlock

    def policy(module: nn.Module) -> bool | Any:
        if isinstance(module, Experts):
            return True if ep_mesh is None else ep_mesh["efsdp"]
        return isinstance(module, MoEBlock)

    return policy


def expert_mesh(device_type: str, world: int, pp: int, ep: int) -> Any:
    """``("efsdp", "ep")``, or ``("pp", "efsdp", "ep")`` under pp (a stage's dp ranks split
    into groups of ``ep`` consecutive ranks); None without EP. A world collective."""
    from torch.distributed.device_mesh import init_device_mesh

    if ep == 1:
        return None
    shape, names = (world // (pp * ep), ep), ("efsdp", "ep")
    if pp > 1:
        shape, names = (pp, *shape), ("pp", *names)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def moe_decoder(cfg: TrainConfig, device: torch.device, mesh: Any) -> nn.Module:
    """The unsharded MoE GPT from ``cfg.seed``: the same dense weights on every rank, each
    expert on the ranks holding it (this rank's experts of ``mesh["ep"]`` only, with EP)."""
    from flatshard.models.moe import MoEGPT
    from flatshard.tools.train.resolve import moe_config

    torch.manual_seed(cfg.seed)
    ep_group = None if mesh is None else mesh["ep"]
    if device.type == "cpu":
        return MoEGPT(moe_config(cfg), ep_group=ep_group)
    with device:
        return MoEGPT(moe_config(cfg), ep_group=ep_group)


def build_moe_model(cfg: TrainConfig, device: torch.device, world: int) -> nn.Module:
    """The sharded MoE GPT, this rank's experts only when ``parallel.ep > 1``."""
    from flatshard.tools.train.resolve import comm, mixed_precision

    mesh = expert_mesh(device.type, world, 1, cfg.parallel.ep)
    model = moe_decoder(cfg, device, mesh)
    return fs.shard(
        model,
        policy=unit_policy(mesh),
        strategy=cfg.parallel.strategy,
        mixed_precision=mixed_precision(cfg),
        timeout_s=cfg.parallel.timeout_s,
        comm=comm(cfg),
    )


def aux_loss(model: nn.Module, micro_batches: int) -> torch.Tensor | None:
    """This micro-batch's share of the load-balancing term (None for a dense model)."""
    coef = getattr(getattr(model, "config", None), "aux_loss_coef", None)
    if coef is None or not hasattr(model, "aux_loss"):
        return None
    return coef * model.aux_loss / micro_batches


@torch.no_grad()
def generate(model: nn.Module, ids: torch.Tensor, tokens: int, generator: torch.Generator):
    """The final sample (top-20 at temperature 0.8, as for the GPT): every rank the same ids,
    one forward per token (the all-to-alls need every ep rank)."""
    from flatshard.models.sampling import generate as sample

    return sample(model, ids, tokens, max_seq_len=model.config.max_seq_len, temperature=0.8,
                  top_k=20, generator=generator)  # fmt: skip
