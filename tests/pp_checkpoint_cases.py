"""One checkpoint across pipeline stages (issue 28 goal 3): the cases behind
tests/test_checkpoint_pipeline.py.

World 4. The whole model (embedding, 4 blocks, norm, head; float64) is cut torchtitan-style:
each stage is a copy of the whole model with the other stages' layers removed, so it keeps
the whole model's names. Route: pp 2 x dp 2 stages train 2 AdamW steps through a schedule and
``fs.save(..., model=stages, optimizer=[one per stage], across=pp)``; a whole model sharded
over all 4 ranks (a different init) loads it with ``fs.load`` and one optimizer of one group,
and must hold exactly the saved state; both sides then take one more step on the same global
batch and must agree. The dp 4 model saves, fresh stages (another init) load that with
``across`` and the two take one more step each. Every rank reports its errors.
"""

from __future__ import annotations

import copy
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

import flatshard as fs
from pipeline_cases import (
    DIM,
    DP,
    SCHEDULES,
    TIMEOUT_S,
    VOCAB,
    Block,
    global_batch,
    loss_fn,
    meshes,
    reference_loss,
    stage_ids,
)

N_MB = 4
BLOCKS = 4


class Whole(nn.Module):
    """The whole model; a stage is a copy with some of these set to ``None`` or removed."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.embed: nn.Module | None = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleDict({str(i): Block() for i in range(BLOCKS)})
        self.norm: nn.Module | None = nn.LayerNorm(DIM)
        self.head: nn.Module | None = nn.Linear(DIM, VOCAB, bias=not tied)
        if tied:  # the last stage's cut holds its own copy (fs.tie_across_stages)
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.norm(x)) if self.head is not None else x


def whole_model(seed: int, tied: bool = False) -> Whole:
    torch.manual_seed(seed)
    return Whole(tied).double()


def cut(whole: Whole, stage: int, n_stages: int) -> Whole:
    """Stage ``stage`` of ``n_stages``, keeping the whole model's names."""
    part = copy.deepcopy(whole)
    per_stage = BLOCKS // n_stages
    keep = {str(i) for i in range(stage * per_stage, (stage + 1) * per_stage)}
    for name in [n for n in part.blocks if n not in keep]:
        del part.blocks[name]
    if stage != 0:
        part.embed = None
    if stage != n_stages - 1:
        part.norm = part.head = None
    return part


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def tensor_parallel(model: Whole, tp_mesh) -> Whole:
    """Each block's ``a`` colwise and ``b`` rowwise over ``tp_mesh`` (plain tensors between
    blocks and stages), or ``model`` unchanged without a mesh."""
    if tp_mesh is not None:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        for block in model.blocks.values():
            parallelize_module(block, tp_mesh, {"a": ColwiseParallel(), "b": RowwiseParallel()})
    return model


class Pipeline:
    """This rank's stages of a pp 2 x dp 2 pipeline (x tp 2 with ``mesh``: a ("pp", "dp",
    "tp") mesh), one AdamW per stage."""

    def __init__(self, schedule: str, seed: int, mesh=None, tied: bool = False) -> None:
        cls, per_rank, style = SCHEDULES[schedule]
        self.pp, self.dp = meshes() if mesh is None else (mesh["pp"], mesh["dp"])
        self.n_stages = 2 * per_rank
        self.ids = stage_ids(self.pp.get_local_rank(), per_rank, style)
        whole = whole_model(seed, tied)
        tp = None if mesh is None else mesh["tp"]
        self.stages = [tensor_parallel(cut(whole, i, self.n_stages), tp) for i in self.ids]
        for stage in self.stages:
            fs.shard(stage, policy=fs.wrap.by_type(Block), mesh=self.dp, timeout_s=TIMEOUT_S)
        pipe = [
            PipelineStage(m, i, self.n_stages, torch.device("cpu"), group=self.pp.get_group())
            for m, i in zip(self.stages, self.ids, strict=True)
        ]
        single = issubclass(cls, torch_schedules.PipelineScheduleSingle)
        self.schedule = cls(pipe[0] if single else pipe, n_microbatches=N_MB, loss_fn=loss_fn)
        if tied:  # the embedding (first stage) and the head's copy (last) stay one weight
            fs.tie_across_stages(
                self.schedule, [{0: "embed.weight", self.n_stages - 1: "head.weight"}]
            )
        self.opts = [adamw(stage.parameters()) for stage in self.stages]

    def step(self, step: int) -> None:
        x, y = global_batch(step, N_MB)
        dp_rank = self.dp.get_local_rank()
        args = (x.chunk(DP)[dp_rank],) if 0 in self.ids else ()
        target = y.chunk(DP)[dp_rank] if self.n_stages - 1 in self.ids else None
        with fs.pipeline_step(self.schedule):
            self.schedule.step(*args, target=target)
        for opt in self.opts:
            opt.step()
            opt.zero_grad()

    def full_state(self) -> dict:
        """The whole model's state dict, on every rank (each stage's from its dp first rank)."""
        mine: dict = {}
        for stage in self.stages:
            mine.update(fs.full_state_dict(stage))
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return {k: v for part in every for k, v in part.items()}


class DataParallel:
    """The whole model sharded over all 4 ranks (or, with ``mesh``, a ("dp", "tp") mesh: dp
    4 x tp 2), one AdamW with one param group."""

    def __init__(self, seed: int, mesh=None, tied: bool = False) -> None:
        self.model = tensor_parallel(whole_model(seed, tied), None if mesh is None else mesh["tp"])
        dp = None if mesh is None else mesh["dp"]
        fs.shard(self.model, policy=fs.wrap.by_type(Block), mesh=dp, timeout_s=TIMEOUT_S)
        self.opt = adamw(self.model.parameters())
        self.rank = dist.get_rank() if dp is None else dp.get_local_rank()
        self.world = dist.get_world_size() if dp is None else dp.size()

    def step(self, step: int) -> None:
        x, y = global_batch(step, N_MB)  # DP * N_MB microbatches of one row: 2 per rank here
        rank, world = self.rank, self.world
        share = DP * N_MB // world
        reference_loss(
            self.model, x.chunk(world)[rank], y.chunk(world)[rank], share // DP
        ).backward()
        self.opt.step()
        self.opt.zero_grad()

    def full_state(self) -> dict:
        return _everywhere(fs.full_state_dict(self.model))


def _everywhere(part: dict) -> dict:
    """The union of every rank's ``part``, on every rank."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, part)
    return {k: v for one in every for k, v in one.items()}


def max_err(a: dict, b: dict) -> tuple[float, str]:
    """The largest error of ``a`` against ``b`` (relative to each tensor's largest element)."""
    if set(a) != set(b):
        return float("inf"), f"keys differ: {sorted(set(a) ^ set(b))[:4]}"
    worst = (0.0, "")
    for key, want in b.items():
        err = (a[key] - want).abs().max().item() / max(want.abs().max().item(), 1e-12)
        worst = max(worst, (err if err == err else float("inf"), key))
    return worst


def shared_dir() -> str:
    """A temporary directory, the same on every rank (rank 0 makes it)."""
    box = [tempfile.mkdtemp(prefix="fs-pp-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run_route(schedule: str, meshes3d: tuple | None = None, tied: bool = False) -> dict:
    """pp -> dp 4 -> pp, with a step after each load; every error this rank sees. With
    ``meshes3d`` (the ("pp", "dp", "tp") and ("dp", "tp") meshes of world 8), every side is
    tensor-parallel too: pp 2 x dp 2 x tp 2 -> dp 4 x tp 2 -> pp 2 x dp 2 x tp 2."""
    root, out = shared_dir(), {}
    mesh3d, mesh2d = meshes3d or (None, None)
    pipe = Pipeline(schedule, seed=0, mesh=mesh3d, tied=tied)
    for step in range(2):
        pipe.step(step)
    saved = pipe.full_state()
    fs.save(f"{root}/pp", model=pipe.stages, optimizer=pipe.opts, across=pipe.pp)
    dp4 = DataParallel(seed=1, mesh=mesh2d, tied=tied)
    fs.load(f"{root}/pp", model=dp4.model, optimizer=dp4.opt)
    out["pp_to_dp4_loaded"] = max_err(dp4.full_state(), saved)
    pipe.step(2)
    dp4.step(2)
    out["pp_to_dp4_next_step"] = max_err(dp4.full_state(), pipe.full_state())
    fs.save(f"{root}/dp4", model=dp4.model, optimizer=dp4.opt)
    fresh = Pipeline(schedule, seed=2, mesh=mesh3d, tied=tied)
    fs.load(f"{root}/dp4", model=fresh.stages, optimizer=fresh.opts, across=fresh.pp)
    out["dp4_to_pp_loaded"] = max_err(fresh.full_state(), dp4.full_state())
    fresh.step(3)
    dp4.step(3)
    out["dp4_to_pp_next_step"] = max_err(fresh.full_state(), dp4.full_state())
    return out


def run_routes(schedules: list[str]) -> dict:
    """Every schedule's route in one pool job: schedule -> errors (or the error raised)."""
    out = {}
    for schedule in schedules:
        try:  # "<schedule>-tied": the embedding and the head share one weight
            name, tied = schedule.removesuffix("-tied"), schedule.endswith("-tied")
            out[schedule] = run_route(name, tied=tied)
        except Exception as exc:  # reported, not raised: the other ranks may be stuck
            out[schedule] = {"raised": f"{type(exc).__name__}: {exc}"}
            raise
    return out


_MESHES_3D: list = []


def run_3d_route() -> dict:
    """World 8: pp 2 x dp 2 x tp 2 (1F1B) -> dp 4 x tp 2 -> back (see ``run_route``)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not _MESHES_3D:  # made once per pool worker (a world collective)
        names3, names2 = ("pp", "dp", "tp"), ("dp", "tp")
        _MESHES_3D.append(init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=names3))
        _MESHES_3D.append(init_device_mesh("cpu", (4, 2), mesh_dim_names=names2))
    return run_route("1F1B", tuple(_MESHES_3D))
