"""Building this rank's pipeline: mesh, stage modules, sharding, PipelineStages, schedule.

See [Note: the trainer's (pp, dp) layout] in ``tools/train/pipeline.py``.
"""

from __future__ import annotations

from typing import Any

import torch

import flatshard as fs
from flatshard.models import GPT, Block
from flatshard.tools.train.config import TrainConfig
from flatshard.tools.train.pipeline import (
    Pipeline,
    StepLoss,
    microbatch_count,
    stage_indices,
    stages_per_rank,
)
from flatshard.tools.train.pipeline_stage import GPTStage, layer_split
from flatshard.tools.train.resolve import gpt_config, mixed_precision

__all__ = ["build_pipeline", "pipeline_mesh"]


def pipeline_mesh(device_type: str, world: int, pp: int) -> Any:
    """The job's ``("pp", "dp")`` DeviceMesh (a collective of the world: every rank)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (pp, world // pp), mesh_dim_names=("pp", "dp"))


def _stage_modules(cfg: TrainConfig, device: torch.device, indices: list[int], n: int) -> list:
    """This rank's stage modules, cut from the whole GPT built from ``cfg.seed`` (the same
    numbers as an unpipelined run), each sharded by Block over its dp mesh afterwards."""
    torch.manual_seed(cfg.seed)
    if device.type == "cpu":
        model = GPT(gpt_config(cfg))
    else:
        with device:
            model = GPT(gpt_config(cfg))
    split = layer_split(model.config.n_layers, n)
    return [GPTStage(model, split[s], first=s == 0, last=s == n - 1) for s in indices]


def _schedule(cfg: TrainConfig, pipe_stages: list, loss: StepLoss) -> Any:
    """The named schedule over this rank's PipelineStages; torch's own refusals (too few
    microbatches for a schedule) are reported with the option that fixes them."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    cls = get_schedule_class(cfg.parallel.schedule)
    single = issubclass(cls, PipelineScheduleSingle)
    stages = pipe_stages[0] if single else pipe_stages
    n = microbatch_count(cfg)
    try:
        return cls(stages, n_microbatches=n, loss_fn=loss, scale_grads=False)
    except ValueError as e:
        raise ValueError(
            f"parallel.schedule={cfg.parallel.schedule!r} with parallel.microbatches={n}: {e}; "
            "pass another --parallelism.microbatches"
        ) from None


def build_pipeline(cfg: TrainConfig, rank: int, world: int, device: torch.device) -> Pipeline:
    """This rank's stages (sharded), their PipelineStages and the schedule."""
    from torch.distributed.pipelining import PipelineStage

    pp, v = cfg.parallel.pp, stages_per_rank(cfg)
    mesh = pipeline_mesh(device.type, world, pp)
    n = pp * v
    indices = stage_indices(mesh["pp"].get_local_rank(), pp, v, cfg.parallel.schedule)
    modules = _stage_modules(cfg, device, indices, n)
    for module in modules:
        fs.shard(
            module,
            policy=fs.wrap.by_type(Block),
            strategy=cfg.parallel.strategy,
            mixed_precision=mixed_precision(cfg),
            mesh=mesh["dp"],
            timeout_s=cfg.parallel.timeout_s,
        )
    group = mesh["pp"].get_group()
    pipe_stages = [
        PipelineStage(m, s, n, device, group=group) for m, s in zip(modules, indices, strict=True)
    ]
    loss = StepLoss(world // pp)
    schedule = _schedule(cfg, pipe_stages, loss)
    if cfg.model.tie_embeddings and n > 1:  # see [Note: whole-model names on every stage]
        fs.tie_across_stages(schedule, [{0: "tok_emb.weight", n - 1: "lm_head.weight"}])
    return Pipeline(
        mesh=mesh,
        stages=modules,
        schedule=schedule,
        loss=loss,
        first=0 in indices,
        last=n - 1 in indices,
    )
