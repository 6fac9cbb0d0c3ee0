"""Building a run from its config: process environment, sharded model, optimizer, LR schedule."""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

import flatshard as fs
from flatshard.comm.attempt_store import attempt_store
from flatshard.models import GPT, Block
from flatshard.tools.train import tp_plan as tensor_parallel
from flatshard.tools.train.config import OptimConfig, TrainConfig
from flatshard.tools.train.resolve import comm, gpt_config, mixed_precision

__all__ = [
    "Env",
    "build_model",
    "build_optimizer",
    "build_scheduler",
    "build_training",
    "flops_per_token",
    "init_distributed",
    "warmup_cosine",
]


@dataclass(frozen=True)
class Env:
    """Where this worker runs."""

    rank: int
    """Global rank."""
    world: int
    """Number of workers in the job."""
    local_world: int
    """Workers on this machine."""
    device: torch.device
    """This worker's compute device (``cuda:LOCAL_RANK`` or ``cpu``)."""
    tp: int = 1
    """Tensor-parallel degree: groups of ``tp`` consecutive ranks split each layer."""
    pp: int = 1
    """Pipeline-parallel degree: ``pp`` groups of ``world / pp`` consecutive ranks, one per
    pipeline rank (see [Note: the trainer's (pp, dp) layout] in tools/train/pipeline.py)."""
    cp: int = 1
    """Context-parallel degree: groups of ``cp`` consecutive ranks split every row (see
    [Note: the trainer's (dp, cp) layout] in tools/train/cp_plan.py)."""

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel rank (the tp or cp ranks of a group, and the pp ranks of a
        dp column, share it and its data)."""
        return (self.rank // (self.tp * self.cp)) % self.dp_world

    @property
    def dp_world(self) -> int:
        """Number of data-parallel ranks (distinct batches per step)."""
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def cp_rank(self) -> int:
        """This rank's place in its cp group (which head-tail share of each row it holds)."""
        return self.rank % self.cp


def init_distributed(backend: str, timeout_s: float, tp: int = 1, pp: int = 1, cp: int = 1) -> Env:
    """Join the job's process group from torchrun's environment variables.

    ``backend`` is ``"nccl"`` (one GPU per worker, by ``LOCAL_RANK``) or ``"gloo"`` (CPU).
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("parallel.backend='nccl' needs CUDA GPUs; use --parallel.backend gloo")
        # srun --gpus-per-task may show each task only its own GPU: index modulo what is visible
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=timeout_s)
    # under torchrun --max-restarts: see [Note: stale keys after a torchrun restart]
    dist.init_process_group(backend, timeout=timeout, **attempt_store(timeout))
    world = dist.get_world_size()  # world: a tool
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return Env(dist.get_rank(), world, local_world, device, tp, pp, cp)  # world: a tool


def build_model(cfg: TrainConfig, env: Env, vocab_needed: int = 258) -> GPT:
    """The GPT, initialised identically on every rank from ``cfg.seed``, sharded by Block.

    Built directly on the device: ``fs.shard`` takes a materialised model and keeps 1/world of
    it per rank, so the full model exists once per rank for a moment (fine for these presets).
    """
    hybrid = cfg.parallel.strategy == "hybrid_shard"
    tp_mesh = None
    if env.tp > 1:  # see [Note: the trainer's (dp, tp) layout]
        tp_mesh = tensor_parallel.build_mesh(
            env.device.type, env.world, env.local_world, env.tp, hybrid
        )
        mesh = tensor_parallel.data_parallel_mesh(tp_mesh)
    else:
        mesh = _hybrid_mesh(env) if hybrid else None
    if cfg.model.hf:  # a transformers model: built on meta, sharded, weights read sliced
        from flatshard.tools.train.hf_model import build_hf_model

        return build_hf_model(
            cfg.model.hf, cfg.seed, cfg.data.seq_len, vocab_needed,
            strategy=cfg.parallel.strategy, mixed_precision=mixed_precision(cfg), mesh=mesh,
            comm=comm(cfg),
            timeout_s=cfg.parallel.timeout_s, tp_mesh=tp_mesh,
        )  # fmt: skip
    if cfg.model.experts:  # see [Note: the trainer's (efsdp, ep) layout]
        from flatshard.tools.train.moe import build_moe_model

        return build_moe_model(cfg, env.device, env.world)
    torch.manual_seed(cfg.seed)
    if env.device.type == "cpu":
        # no ``with device:`` here: that mode sends nn.init through torch._refs, whose first
        # use imports ~4 s of compiler machinery on this box
        model = GPT(gpt_config(cfg))
    else:
        with env.device:
            model = GPT(gpt_config(cfg))
    model = convert_model(model, cfg, env.device)  # float8 before TP: [Note: float8 under TP]
    if tp_mesh is not None:
        tensor_parallel.parallelize(model, tp_mesh, cfg)
    if env.cp > 1:  # see [Note: the trainer's (dp, cp) layout]; fs.shard over all ranks
        from flatshard.tools.train.cp_plan import parallelize, resolve_cp_attention

        attention = resolve_cp_attention(cfg, env.device.type)
        parallelize(model, env.device.type, env.world, env.cp, attention)
    return fs.shard(
        model,
        policy=fs.wrap.by_type(Block),
        strategy=cfg.parallel.strategy,
        mixed_precision=mixed_precision(cfg),
        mesh=mesh,
        timeout_s=cfg.parallel.timeout_s,
        comm=comm(cfg),
    )


def _hybrid_mesh(env: Env) -> object:
    """hybrid_shard's 2-D mesh: replicate across machines, shard within one (fast links)."""
    from torch.distributed.device_mesh import init_device_mesh

    nodes, per_node = divmod(env.world, env.local_world)
    if per_node:
        raise ValueError(
            f"parallel.strategy='hybrid_shard' needs the same number of workers on every "
            f"machine, but world size {env.world} is not a multiple of {env.local_world} "
            "workers here; use full_shard"
        )
    return init_device_mesh(
        env.device.type, (nodes, env.local_world), mesh_dim_names=("replicate", "shard")
    )


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """``cfg.name``: AdamW; Muon for the blocks' matrices plus AdamW for the rest (one
    ``fs.optim.Combined``, AdamW's groups first); or Adafactor. Norms and biases skip weight
    decay. After sharding every parameter is a 1-D fragment, so ``p.ndim`` cannot tell a
    matrix from a norm: decide by the (preserved) name and ``fs.full_shape``."""
    muon: list[torch.nn.Parameter] = []
    if cfg.name == "muon":
        muon = fs.optim.muon_split(model)[0]
    chosen = {id(p) for p in muon}
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in chosen:
            (no_decay if "norm" in name or name.endswith("bias") else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if cfg.name == "adafactor":
        return fs.optim.Adafactor(groups, lr=cfg.lr)
    adamw = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if cfg.name == "adamw":
        return adamw
    matrices = fs.optim.Muon(
        muon, lr=cfg.muon_lr, momentum=cfg.muon_momentum, weight_decay=cfg.weight_decay
    )
    return fs.optim.Combined(adamw, matrices)


def warmup_cosine(cfg: OptimConfig) -> Callable[[int], float]:
    """LR multiplier of step index ``i`` (0-based): linear warm-up to 1 over ``warmup_steps``,
    then cosine down to ``min_lr_ratio`` at ``decay_steps``, flat after that."""
    warmup, total, floor = cfg.warmup_steps, cfg.decay_steps, cfg.min_lr_ratio

    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        progress = min(1.0, (i - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> LambdaLR:
    """The warm-up + cosine schedule; ``cfg.decay_steps`` must be resolved (non-zero)."""
    assert cfg.decay_steps > 0, "resolve() sets decay_steps before the scheduler is built"
    return LambdaLR(optimizer, warmup_cosine(cfg))


def build_training(cfg: TrainConfig, env: Env, vocab: int) -> tuple[Any, Any, LambdaLR, Any]:
    """The sharded model, its optimizer and LR schedule, and None; with pp > 1 this rank's
    stage modules (a list), the first stage's optimizer and schedule, and the ``Pipeline``
    holding one of each per stage (stepped together)."""
    _check_float8(cfg, env)
    if env.pp == 1:
        model = build_model(cfg, env, vocab)
        # identical init everywhere, then a per-rank stream: dropout masks differ between ranks
        torch.manual_seed(cfg.seed * 1_000_003 + 1 + env.rank)
        optimizer = build_optimizer(model, cfg.optim)
        return model, optimizer, build_scheduler(optimizer, cfg.optim), None
    from flatshard.tools.train.pipeline_build import build_pipeline

    pipe = build_pipeline(cfg, env.rank, env.world, env.device, env.local_world, vocab)
    torch.manual_seed(cfg.seed * 1_000_003 + 1 + env.rank)
    pipe.optimizers = [build_optimizer(m, cfg.optim) for m in pipe.stages]
    pipe.schedulers = [build_scheduler(o, cfg.optim) for o in pipe.optimizers]
    return pipe.stages, pipe.optimizers[0], pipe.schedulers[0], pipe


def convert_model(model: GPT, cfg: TrainConfig, device: torch.device) -> GPT:
    """``--model.float8``: the blocks' linears to torchao's float8 (docs/float8.md)."""
    if not cfg.model.float8:
        return model
    from flatshard.features.float8 import convert_linears

    return convert_linears(model, emulate=device.type == "cpu", prefix="layers.")


def _check_float8(cfg: TrainConfig, env: Env) -> None:
    """--model.float8 covers the dense GPT under data, tensor and pipeline parallelism."""
    other = {"model.hf": cfg.model.hf, "model.experts": cfg.model.experts,
             "parallelism.cp": env.cp > 1}  # fmt: skip
    used = [name for name, on in other.items() if on]
    if cfg.model.float8 and used:
        raise ValueError(
            f"model.float8=true is not supported with {', '.join(used)}: pass --model.float8 "
            "false, or train the dense GPT with data, tensor and pipeline parallelism only"
        )


def flops_per_token(cfg: TrainConfig, model: Any, attention_length: float) -> float:
    """Training FLOPs per token (for MFU) of the GPT, the MoE GPT (active parameters), the
    pipeline's whole GPT, or a Hugging Face model."""
    if cfg.model.experts:  # the active parameters: router + top_k experts per layer
        from flatshard.tools.train.resolve import moe_config

        return moe_config(cfg).flops_per_token(round(attention_length))
    if isinstance(model, list) and cfg.model.hf:  # pipeline stages of a transformers model
        from flatshard.tools.train.pipeline_hf import flops_per_token as hf_stage_flops

        return hf_stage_flops(model[0], attention_length)
    if isinstance(model, list):  # pipeline stages: the whole GPT's count
        return gpt_config(cfg).flops_per_token(attention_length)
    from flatshard.tools.train import hf_model

    return hf_model.flops_per_token(model, attention_length)
