"""Pipeline parallelism with sharded stages: the cases behind tests/test_pipeline.py.

World 4 = pp 2 x dp 2. A tiny heterogeneous model (embedding + block on the first stage,
blocks in the middle, block + norm + head on the last; the cross-entropy is the schedule's
``loss_fn``) is cut into one stage per pp rank (single-stage schedules) or two (multi-stage
ones: looped, or V-shaped for ZBV/DualPipeV). Each stage is sharded over the dp mesh, driven by
one ``torch.distributed.pipelining`` schedule for ``STEPS`` optimizer steps, and its full state
dict is compared with a single-process copy of the whole model trained on the global batch.

Engines: ``flatshard`` (``fs.shard(stage, policy=fs.wrap.by_type(Block), mesh=dp)``);
``fsdp2`` (``fully_shard`` per block, then the stage, torch's defaults); ``fsdp2_keep`` (the
same with ``reshard_after_forward=False``, torchtitan's setting under PP); ``plain`` (no
sharding, gradients all-reduced over dp by hand: what torch's schedule alone gives).

``case_schedules(specs)`` runs many specs in one pool job. A spec that raises (a short
``TIMEOUT_S`` bounds every wait: flatshard's, and the Gloo groups' of the meshes) is reported
with its error, never re-raised, so the pool is not rebuilt and later specs still run.
"""

from __future__ import annotations

import copy
import datetime
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

import flatshard as fs

PP, DP = 2, 2
VOCAB, DIM, SEQ = 16, 8, 4
ROWS = 1  # rows per microbatch
STEPS = 3
TIMEOUT_S = 15  # every wait of a case: a stuck one raises within this
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
}
TOLERANCE = {"sgd": 1e-6, "adamw": 1e-5}
# name -> (schedule class, stages per rank, stage-to-rank style)
SCHEDULES = {
    "GPipe": (torch_schedules.ScheduleGPipe, 1, "loop"),
    "1F1B": (torch_schedules.Schedule1F1B, 1, "loop"),
    "Interleaved1F1B": (torch_schedules.ScheduleInterleaved1F1B, 2, "loop"),
    "LoopedBFS": (torch_schedules.ScheduleLoopedBFS, 2, "loop"),
    "InterleavedZeroBubble": (torch_schedules.ScheduleInterleavedZeroBubble, 2, "loop"),
    "ZBVZeroBubble": (torch_schedules.ScheduleZBVZeroBubble, 2, "v"),
    "DualPipeV": (torch_schedules.ScheduleDualPipeV, 2, "v"),
}


def torch_schedule_classes() -> set[str]:
    """Every public, concrete schedule class torch ships (the abstract bases left out)."""
    bases = {"PipelineScheduleSingle", "PipelineScheduleMulti"}
    return {
        name
        for name, obj in vars(torch_schedules).items()
        if isinstance(obj, type)
        and issubclass(obj, torch_schedules._PipelineSchedule)
        and not name.startswith("_")
        and name not in bases
    }


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


class Stage(nn.Module):
    """One pipeline stage: the embedding on the first, norm + head on the last."""

    def __init__(self, first: bool, last: bool, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM) if first else None
        self.blocks = nn.Sequential(*[Block() for _ in range(blocks)])
        self.norm = nn.LayerNorm(DIM) if last else None
        self.head = nn.Linear(DIM, VOCAB) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        x = self.blocks(x)
        return self.head(self.norm(x)) if self.head is not None else x


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The schedule's loss: the mean over one microbatch's tokens."""
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def build_stages(n_stages: int) -> list[Stage]:
    """The whole model (4 blocks), cut into ``n_stages`` stages; the same on every rank."""
    torch.manual_seed(0)
    per_stage = 4 // n_stages
    return [Stage(i == 0, i == n_stages - 1, per_stage) for i in range(n_stages)]


def stage_ids(pp_rank: int, per_rank: int, style: str) -> list[int]:
    """The stages ``pp_rank`` holds: ``r, r + PP, ...`` (loop), or ``r, 2 PP - 1 - r`` (V)."""
    if style == "v":
        return [pp_rank, 2 * PP - 1 - pp_rank]
    return [pp_rank + k * PP for k in range(per_rank)]


def global_batch(step: int, n_mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    shape = (DP * n_mb * ROWS, SEQ)
    return torch.randint(VOCAB, shape, generator=g), torch.randint(VOCAB, shape, generator=g)


def reference_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, n_mb: int):
    """What the pipeline optimises: every microbatch's mean loss (the schedule's backwards
    sum them), divided by the microbatches (``scale_grads=True``) and by dp (the engines
    average over dp): the mean of all ``DP * n_mb`` microbatch losses."""
    chunks = DP * n_mb
    losses = [
        loss_fn(model(xm), ym) for xm, ym in zip(x.chunk(chunks), y.chunk(chunks), strict=True)
    ]
    return sum(losses) / chunks


# This process's (pp mesh, dp mesh): made once and reused by every spec (a Gloo group holds
# threads and sockets, and the pool's workers live for the whole session; destroying groups
# is no option: DTensor caches by mesh value, and a new equal mesh resolves the old names).
_MESHES: list = []
_FAILED = [False]  # a spec failed on this rank: its groups may hold stray messages


def meshes():
    """(pp mesh, dp mesh), with ``TIMEOUT_S`` on their Gloo groups so that a stuck
    point-to-point or collective raises. Made again, by every rank (making a mesh is a world
    collective), when a spec failed on any rank (one small world all-reduce decides)."""
    again = torch.tensor([int(_FAILED[0] or not _MESHES)])
    dist.all_reduce(again, op=dist.ReduceOp.MAX)
    if again.item():
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=TIMEOUT_S)
        mesh = init_device_mesh(
            "cpu",
            (PP, DP),
            mesh_dim_names=("pp", "dp"),
            backend_override={"pp": ("gloo", opts), "dp": ("gloo", opts)},
        )
        _MESHES[:] = [mesh["pp"], mesh["dp"]]
        _FAILED[0] = False
    return tuple(_MESHES)


def shard_stage(stage: Stage, engine: str, dp_mesh) -> None:
    if engine in ("flatshard", "flatshard_plain"):  # plain: schedule.step() without pipeline_step
        fs.shard(stage, policy=fs.wrap.by_type(Block), mesh=dp_mesh, timeout_s=TIMEOUT_S)
    elif engine in ("fsdp2", "fsdp2_keep"):
        from torch.distributed.fsdp import fully_shard

        keep = engine == "fsdp2_keep"
        for block in stage.blocks:
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=not keep)
        fully_shard(stage, mesh=dp_mesh, reshard_after_forward=not keep)


def reductions(stage: nn.Module) -> int:
    """flatshard's reductions a step needs at least: one per bucket of coalesced units, one
    per other unit holding parameters."""
    units = fs.units(stage)
    buckets = {u.bucket for u in units if u.bucket is not None}
    return len(buckets) + sum(1 for u in units if u.bucket is None and u.numel)


def full_state(stage: nn.Module, engine: str) -> dict | None:
    """The stage's full state dict where this rank holds it (flatshard: the dp mesh's first
    rank; FSDP2: every rank, from ``full_tensor``; plain: every rank), else None."""
    if engine.startswith("flatshard"):
        return fs.full_state_dict(stage) or None
    if engine == "plain":
        return {k: v.detach().clone() for k, v in stage.state_dict().items()}
    return {k: v.full_tensor() for k, v in stage.state_dict().items()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to ``b``'s largest element (inf on NaN)."""
    err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)
    return err if err == err else float("inf")


class Run:
    """One spec on this rank: meshes, this rank's stages, the schedule, the reference."""

    def __init__(self, spec: dict) -> None:
        cls, per_rank, style = SCHEDULES[spec["schedule"]]
        per_rank = spec.get("per_rank", per_rank)  # a multi-stage schedule may run one
        self.n_mb, self.engine = spec["microbatches"], spec["engine"]
        self.stall = spec.get("stall_rank") == dist.get_rank()  # the harness's own test
        self.n_stages = PP * per_rank
        pp_mesh, self.dp_mesh = meshes()
        self.pp_mesh = pp_mesh
        self.norm_err = 0.0  # flatshard: the whole model's gradient norm (across stages)
        self.dp_rank = self.dp_mesh.get_local_rank()
        self.ids = stage_ids(pp_mesh.get_local_rank(), per_rank, style)
        whole = build_stages(self.n_stages)
        if spec.get("float8"):  # test_float8: the blocks' linears torchao float8, both sides
            from float8_cases import convert_blocks

            whole = [convert_blocks(stage) for stage in whole]
        self.ref = nn.Sequential(*copy.deepcopy(whole))
        self.mine = [whole[i] for i in self.ids]
        for module in self.mine:
            shard_stage(module, self.engine, self.dp_mesh)
        self.schedule = make_schedule(cls, self, pp_mesh.get_group())
        self.opt = OPTIMIZERS[spec["optim"]]([p for m in self.mine for p in m.parameters()])
        self.ref_opt = OPTIMIZERS[spec["optim"]](self.ref.parameters())

    def step(self, step: int) -> list[float] | None:
        """One optimizer step of both; per stage, flatshard's reduce-scatters per reduction."""
        x, y = global_batch(step, self.n_mb)
        counting = self.engine == "flatshard"
        for m in self.mine if counting else ():
            fs.comm_stats(m, reset=True)
        args = (x.chunk(DP)[self.dp_rank],) if 0 in self.ids else ()
        last = self.n_stages - 1 in self.ids
        if self.stall and step == 1:  # the harness's own test: peers time out, not hang
            raise RuntimeError(f"rank {dist.get_rank()} gave up at step {step}")
        target = y.chunk(DP)[self.dp_rank] if last else None
        if self.engine == "flatshard":
            with fs.pipeline_step(self.schedule):
                self.schedule.step(*args, target=target)
        else:
            self.schedule.step(*args, target=target)
        if self.engine == "plain":  # torch's schedule alone: average over dp by hand
            for p in (p for m in self.mine for p in m.parameters() if p.grad is not None):
                dist.all_reduce(p.grad, group=self.dp_mesh.get_group())
                p.grad.div_(DP)
        reference_loss(self.ref, x, y, self.n_mb).backward()
        if counting:  # one norm over every stage of every pp rank (measured, not clipped)
            norm = fs.clip_grad_norm_(self.mine, 1e9, across=self.pp_mesh).item()
            ref_norm = torch.nn.utils.clip_grad_norm_(self.ref.parameters(), 1e9).item()
            self.norm_err = max(self.norm_err, abs(norm - ref_norm) / ref_norm)
        for opt in (self.opt, self.ref_opt):
            opt.step()
            opt.zero_grad()
        if not counting:
            return None
        return [fs.comm_stats(m).calls["reduce_scatter"] / reductions(m) for m in self.mine]

    def compare(self) -> dict:
        """The worst error over the stages whose full state this rank holds."""
        out: dict = {"held": [], "err": 0.0, "worst": ""}
        for module, i in zip(self.mine, self.ids, strict=True):
            full = full_state(module, self.engine)
            if full is None:
                continue
            out["held"].append(i)
            for key, value in self.ref[i].state_dict().items():
                if (err := rel_err(full[key], value)) >= out["err"]:
                    out["err"], out["worst"] = err, f"stage {i} {key}"
        return out


def make_schedule(cls, run, group, loss=loss_fn):
    """``cls`` over ``run``'s stage modules (``run.mine`` at ``run.ids`` of ``run.n_stages``),
    each a ``PipelineStage`` on ``group``, ``run.n_mb`` microbatches, ``loss`` per one."""
    stages = [
        PipelineStage(m, i, run.n_stages, torch.device("cpu"), group=group)
        for m, i in zip(run.mine, run.ids, strict=True)
    ]
    single = issubclass(cls, torch_schedules.PipelineScheduleSingle)
    return cls(stages[0] if single else stages, n_microbatches=run.n_mb, loss_fn=loss)


def run_spec(spec: dict) -> dict:
    run = Run(spec)
    per_step = [run.step(step) for step in range(STEPS)]
    out = run.compare()
    # steady state: the first step also counts the schedule's shape-inference backward
    out["norm_err"] = run.norm_err
    return {**out, "rs_per_unit_step": per_step[-1], "rs_first_step": per_step[0]}


def case_example(schedule: str, steps: int) -> list[float]:
    """examples/pipeline.py's training loop on the pool (its torchrun run is slow-marked)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "pipeline.py"
    spec = importlib.util.spec_from_file_location("pipeline_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.train(schedule, steps, microbatches=4, rows=4)


def case_ready() -> int:
    """Nothing: waits for the pool's workers to be up (their start is not a case's time)."""
    return dist.get_rank()


def describe(exc: BaseException) -> str:
    """The exception and its innermost cause (torch wraps a stage's error), shortened."""
    root = exc
    while root.__cause__ is not None:
        root = root.__cause__
    text = f"{type(exc).__name__}: {exc}".split("\n")[0]
    if root is not exc:
        text += f" <- {type(root).__name__}: {root}"
    return " ".join(text.split())[:300]


def run_each(specs: list[dict], run_one, failed: list[bool]) -> list[dict]:
    """``run_one(spec)`` for each spec on this rank: its result, or the error it raised
    (recorded, not raised: every wait times out, and the next spec still runs; ``failed[0]``
    tells the next job that this rank's groups may hold stray messages)."""
    results = []
    for spec in specs:
        start = time.perf_counter()
        try:
            result = run_one(spec)
        except Exception as exc:
            result = {"error": describe(exc)}
            failed[0] = True
        result["seconds"] = round(time.perf_counter() - start, 2)
        results.append(result)
    return results


def case_schedules(specs: list[dict]) -> list[dict]:
    """Each spec on every rank: per spec this rank's result, or the error it raised."""
    return run_each(specs, run_spec, _FAILED)


def merge(spec: dict, per_rank: list[dict]) -> dict:
    """One spec's results over the ranks: worst error, who held which stage, counts."""
    errors = [r["error"] for r in per_rank if "error" in r]
    if errors:
        return {**spec, "error": errors[0]}
    counts = [c for r in per_rank for c in r["rs_per_unit_step"] or ()]
    worst = max(per_rank, key=lambda r: r["err"])
    return {
        **spec,
        "err": worst["err"],
        "worst": worst["worst"],
        "held": sorted({i for r in per_rank for i in r["held"]}),
        "holders": [rank for rank, r in enumerate(per_rank) if r["held"]],
        "rs_per_unit_step": max(counts, default=None),  # the stage that reduces most often
        "rs_min": min(counts, default=None),
        "rs_first_step": max((c for r in per_rank for c in r["rs_first_step"] or ()), default=None),
        "seconds": max(r["seconds"] for r in per_rank),
        "norm_err": max(r.get("norm_err", 0.0) for r in per_rank),
    }
