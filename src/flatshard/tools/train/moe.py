"""``flatshard train --model.experts E [--model.top_k K] [--parallelism.ep N]``: the MoE GPT.

[Note: the trainer's (efsdp, ep) layout]
With ``model.experts = E > 0`` the trainer builds ``flatshard.models.moe.MoEGPT`` (every
block's MLP is ``E`` SwiGLU experts of width ``d_ff``, token-choice top-``K`` routing). With
``parallel.ep = N > 1`` the ranks form a mesh ``("efsdp", "ep")`` of shape ``(world / N, N)``
(the ep peers consecutive): each rank holds ``E / N`` experts per layer, routed tokens travel
to them and back by all-to-all over ``mesh["ep"]``, and each ``Experts`` unit is sharded over
``mesh["efsdp"]`` (the ranks holding the same experts: a per-unit mesh, returned by the wrap
policy); the dense part of every ``MoEBlock`` is sharded over all ranks as usual.

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

__all__ = ["aux_loss", "build_moe_model", "check_ep", "is_moe"]


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
    for name, value in (("parallel.tp", p.tp), ("parallel.pp", p.pp)):
        if value > 1:
            raise ValueError(
                f"{name}={value} cannot be combined with model.experts yet; pass --{name} 1"
            )
    if p.strategy == "hybrid_shard":
        raise ValueError(
            "parallel.strategy='hybrid_shard' cannot be combined with model.experts yet; "
            "pass full_shard"
        )
    if world % p.ep or m.experts % p.ep:
        raise ValueError(
            f"parallel.ep={p.ep} must divide the world size {world} and model.experts="
            f"{m.experts}; pass a --parallelism.ep that divides both"
        )


def is_moe(cfg: TrainConfig) -> bool:
    return cfg.model.experts > 0


def _policy(ep_mesh: Any) -> Any:
    """Units: every ``MoEBlock`` over the model's mesh; every ``Experts`` over the ranks that
    hold the same experts (``efsdp``), or as a plain unit without EP."""
    from flatshard.models.moe import Experts, MoEBlock

    def policy(module: nn.Module) -> bool | Any:
        if isinstance(module, Experts):
            return True if ep_mesh is None else ep_mesh["efsdp"]
        return isinstance(module, MoEBlock)

    return policy


def build_moe_model(cfg: TrainConfig, device: torch.device, world: int) -> nn.Module:
    """The sharded MoE GPT, this rank's experts only when ``parallel.ep > 1``."""
    from torch.distributed.device_mesh import init_device_mesh

    from flatshard.models.moe import MoEGPT
    from flatshard.tools.train.resolve import mixed_precision, moe_config

    ep = cfg.parallel.ep
    mesh = None
    if ep > 1:
        mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
    torch.manual_seed(cfg.seed)  # the same dense weights everywhere, each expert on its holders
    if device.type == "cpu":
        model = MoEGPT(moe_config(cfg), ep_group=None if mesh is None else mesh["ep"])
    else:
        with device:
            model = MoEGPT(moe_config(cfg), ep_group=None if mesh is None else mesh["ep"])
    return fs.shard(
        model,
        policy=_policy(mesh),
        strategy=cfg.parallel.strategy,
        mixed_precision=mixed_precision(cfg),
        timeout_s=cfg.parallel.timeout_s,
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
