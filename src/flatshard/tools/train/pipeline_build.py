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
from flatshard.tools.train.resolve import comm, gpt_config, mixed_precision

__all__ = ["build_pipeline", "data_parallel_mesh", "hybrid_shard_degree", "pipeline_mesh"]


def hybrid_shard_degree(world: int, local_world: int, pp: int, tp: int) -> int:
    """hybrid_shard's ``shard`` size under pp: the dp ranks of one stage on one machine (pp
    outermost, so a stage's ``world / pp`` ranks are consecutive); ``replicate`` spans machines."""
    dp = world // (pp * tp)
    shard = min(local_world // tp, dp) if local_world % tp == 0 and world % local_world == 0 else 0
    if not shard or dp % shard:
        raise ValueError(
            f"parallel.strategy='hybrid_shard' with parallel.pp={pp}, parallel.tp={tp}: the "
            f"{dp} data-parallel ranks of a stage cannot be split into machines of "
            f"{local_world} workers (world {world}); start the same number of workers on every "
            f"machine, a multiple of tp, dividing or divisible by {dp * tp}; or use full_shard"
        )
    return shard


def pipeline_mesh(device_type: str, world: int, pp: int, tp: int = 1, shard: int = 0) -> Any:
    """The job's mesh, pp outermost and tp innermost (torchtitan's order): ``("pp", "dp")``,
    ``("pp", "dp", "tp")`` with tp > 1, and ``"dp"`` split into ``("replicate", "shard")`` when
    ``shard`` (hybrid_shard's shard size) is given. A collective of the world: every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    dp = world // (pp * tp)
    data = [("replicate", dp // shard), ("shard", shard)] if shard else [("dp", dp)]
    dims = [("pp", pp), *data]
    if tp > 1:
        dims.append(("tp", tp))
    names, shape = zip(*dims, strict=True)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def data_parallel_mesh(mesh: Any) -> Any:
    """``fs.shard``'s ``mesh=`` for each stage: the dims between pp and tp."""
    names = tuple(n for n in mesh.mesh_dim_names if n not in ("pp", "tp"))
    return mesh[names[0]] if len(names) == 1 else mesh[names]


def _whole_model(cfg: TrainConfig, device: torch.device, experts: Any) -> torch.nn.Module:
    """The whole GPT (or MoE GPT, this rank's experts only) from ``cfg.seed``: the same numbers
    as an unpipelined run."""
    if cfg.model.experts:
        from flatshard.tools.train.moe import moe_decoder

        return moe_decoder(cfg, device, experts)
    torch.manual_seed(cfg.seed)
    if device.type == "cpu":
        return GPT(gpt_config(cfg))
    with device:
        return GPT(gpt_config(cfg))


def _stage_modules(
    cfg: TrainConfig, device: torch.device, indices: list[int], mesh: Any, experts: Any
) -> list:
    """This rank's stage modules cut from the whole model; made tensor-parallel with it when
    the mesh has ``tp``; each sharded over its dp mesh afterwards. MoE stages weigh their
    routers' loss as the unpipelined trainer does, per pipeline microbatch."""
    model = _whole_model(cfg, device, experts)
    n = cfg.parallel.pp * stages_per_rank(cfg)
    split = layer_split(model.config.n_layers, n)
    stages = [GPTStage(model, split[s], first=s == 0, last=s == n - 1) for s in indices]
    if cfg.model.experts:
        coef = model.config.aux_loss_coef / (model.config.n_layers * microbatch_count(cfg))
        for stage in stages:
            stage.aux_scale = coef
    if cfg.model.float8:  # the blocks' linears, as the unpipelined run's (docs/float8.md)
        from flatshard.features.float8 import convert_linears

        for stage in stages:
            convert_linears(stage, emulate=device.type == "cpu", prefix="layers.")
    if "tp" in mesh.mesh_dim_names:  # the stages hold the model's modules: made TP in place
        from flatshard.tools.train.tp_plan import parallelize

        parallelize(model, mesh, cfg)
        _parallelize_head_copy(stages, model, mesh, cfg)
    return stages


def _parallelize_head_copy(stages: list, model: Any, mesh: Any, cfg: TrainConfig) -> None:
    """The last stage's own copy of a tied head (``GPTStage``) is no module of ``model``, so
    ``parallelize`` missed it: split it as the GPT's head, ``Shard(0)`` like the embedding,
    which ``fs.tie_across_stages`` needs ([Note: tensor-parallel tied copies])."""
    from flatshard.models.tensor_parallel import parallelize_gpt_head

    for stage in stages:
        if stage.lm_head is not None and stage.lm_head is not model.lm_head:
            parallelize_gpt_head(
                stage.lm_head, mesh["tp"], loss_parallel=cfg.parallel.loss_parallel
            )


def _shard_stage(cfg: TrainConfig, module: torch.nn.Module, mesh: Any, experts: Any) -> None:
    """``fs.shard`` one stage over its dp ranks: by Block, or MoE's units (experts over the
    ranks holding the same ones)."""
    policy = fs.wrap.by_type(Block)
    if cfg.model.experts:
        from flatshard.tools.train.moe import unit_policy

        policy = unit_policy(experts)
    fs.shard(
        module,
        policy=policy,
        strategy=cfg.parallel.strategy,
        mixed_precision=mixed_precision(cfg),
        mesh=data_parallel_mesh(mesh),
        timeout_s=cfg.parallel.timeout_s,
        comm=comm(cfg),
    )


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


def _ties(cfg: TrainConfig, n: int) -> list[dict[int, str]]:
    """The parameters the first and last of ``n`` stages both hold: a tied head."""
    if cfg.model.hf:  # see [Note: tied embeddings in HF stages]
        from flatshard.tools.train.pipeline_hf import hf_ties

        return hf_ties(cfg, n)
    if cfg.model.tie_embeddings and n > 1:  # see [Note: whole-model names on every stage]
        return [{0: "tok_emb.weight", n - 1: "lm_head.weight"}]
    return []


def build_pipeline(
    cfg: TrainConfig, rank: int, world: int, device: torch.device, local_world: int = 0,
    vocab_needed: int = 258,
) -> Pipeline:  # fmt: skip
    """This rank's stages (tensor-parallel, sharded), their PipelineStages and the schedule.
    ``local_world``: the workers per machine (hybrid_shard's shard size; 0 = ``world``);
    ``vocab_needed``: the ids a ``model.hf`` vocabulary must hold."""
    from torch.distributed.pipelining import PipelineStage

    pp, tp, v = cfg.parallel.pp, cfg.parallel.tp, stages_per_rank(cfg)
    shard = 0
    if cfg.parallel.strategy == "hybrid_shard":
        shard = hybrid_shard_degree(world, local_world or world, pp, tp)
    mesh = pipeline_mesh(device.type, world, pp, tp, shard)
    experts = None
    if cfg.model.experts:
        from flatshard.tools.train.moe import expert_mesh

        experts = expert_mesh(device.type, world, pp, cfg.parallel.ep)
    n = pp * v
    indices = stage_indices(mesh["pp"].get_local_rank(), pp, v, cfg.parallel.schedule)
    if cfg.model.hf:  # a transformers model: built on meta, cut, sharded (pipeline_hf)
        from flatshard.tools.train.pipeline_hf import build_hf_stages

        dp_mesh, tp_mesh = data_parallel_mesh(mesh), mesh["tp"] if tp > 1 else None
        modules = build_hf_stages(cfg, device, indices, n, dp_mesh, vocab_needed, tp_mesh)
    else:
        modules = _stage_modules(cfg, device, indices, mesh, experts)
        for module in modules:
            _shard_stage(cfg, module, mesh, experts)
    group = mesh["pp"].get_group()
    pipe_stages = [
        PipelineStage(m, s, n, device, group=group) for m, s in zip(modules, indices, strict=True)
    ]
    loss = StepLoss(world // (pp * tp))
    schedule = _schedule(cfg, pipe_stages, loss)
    if ties := _ties(cfg, n):
        fs.tie_across_stages(schedule, ties)
    return Pipeline(
        mesh=mesh,
        stages=modules,
        schedule=schedule,
        loss=loss,
        first=0 in indices,
        last=n - 1 in indices,
    )
