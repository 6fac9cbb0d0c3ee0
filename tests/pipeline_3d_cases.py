"""pp x dp x tp: the cases behind tests/test_pipeline_3d.py (issue 28, goal 4).

World 8 = pp 2 x dp 2 x tp 2 on one ``DeviceMesh`` ``("pp", "dp", "tp")``. The transformer of
``tp_cases.py`` (embedding, pre-norm blocks of attention and MLP, final norm, head; float64)
is cut into stages: the embedding and the first blocks on the first, the last blocks, the
norm and the head on the last. Each stage is made tensor-parallel with torch's
``parallelize_module`` on ``mesh["tp"]`` (torchtitan's plan: q/k/v and the MLP's first
layer colwise, the output projections rowwise, the embedding rowwise, the head colwise; with
``sp`` the norms are ``SequenceParallel``), then sharded by ``fs.shard`` over ``mesh["dp"]``
(or the named ``mesh["dp", "tp"]``, whose tp dim flatshard removes), and driven by a
``torch.distributed.pipelining`` schedule over ``mesh["pp"]`` inside ``fs.pipeline_step``.
Gradients are clipped by ``fs.clip_grad_norm_(stages, MAX_NORM, across=mesh["pp"])`` (below
the first steps' norms: clipping acts). The reference is one process training the whole model
(no TP, no sharding) on the global batch.

[Note: activations between stages]
``PipelineStage`` sends what a stage returns. Under the plan every module's output is a plain
tensor (``use_local_output=True``, the styles' default): the residual stream is the TP-local
tensor, the whole sequence without ``sp`` and this tp rank's half of it (``Shard(1)``) with
``sp``. A stage therefore sends its tp rank's local activation to the same tp rank of the
next stage (the pp group joins ranks of equal dp and tp coordinates), and the next stage's
first module reads it in the layout the plan declares (``SequenceParallel`` takes a plain
input as ``Shard(1)``). The head returns replicated logits, so the loss is plain too.
"""

from __future__ import annotations

import copy
import datetime

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import flatshard as fs
from pipeline_cases import make_schedule
from tp_cases import DIM, OPTIMIZERS, SEQ, VOCAB, Block

PP, DP, TP = 2, 2, 2
BLOCKS = 4  # over all stages
ROWS = 1  # rows per microbatch per dp rank
STEPS = 3
MAX_NORM = 0.5
TIMEOUT_S = 30
TOLERANCE = {"sgd": 1e-12, "adamw": 1e-10}  # float64: tighter than the fp32 1e-6 / 1e-5
SCHEDULES = {  # name -> (class, stages per rank, stage-to-rank style)
    "1F1B": (torch_schedules.Schedule1F1B, 1, "loop"),
    "Interleaved1F1B": (torch_schedules.ScheduleInterleaved1F1B, 2, "loop"),
    "InterleavedZeroBubble": (torch_schedules.ScheduleInterleavedZeroBubble, 2, "loop"),
    "ZBVZeroBubble": (torch_schedules.ScheduleZBVZeroBubble, 2, "v"),
    "DualPipeV": (torch_schedules.ScheduleDualPipeV, 2, "v"),
}


class Stage3D(nn.Module):
    """One stage: the embedding on the first, norm + head on the last (``tp_cases`` names)."""

    def __init__(self, first: bool, last: bool, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM) if first else None
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.norm = nn.LayerNorm(DIM) if last else None
        self.head = nn.Linear(DIM, VOCAB, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)) if self.head is not None else x


def build_stages(n_stages: int) -> list[Stage3D]:
    """The whole model cut into ``n_stages``; the same on every rank (float64)."""
    torch.manual_seed(0)
    per = BLOCKS // n_stages
    stages = [Stage3D(i == 0, i == n_stages - 1, per) for i in range(n_stages)]
    return [s.to(torch.float64) for s in stages]


def parallelize_stage(stage: Stage3D, tp_mesh, *, sp: bool) -> None:
    """torchtitan's llama plan on one stage (see [Note: activations between stages])."""
    seq = Shard(1) if sp else Replicate()
    plan = {}
    if stage.embed is not None:
        plan["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if stage.head is not None:
        plan["head"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
        if sp:
            plan["norm"] = SequenceParallel()
    if plan:
        parallelize_module(stage, tp_mesh, plan)
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for block in stage.blocks:
        block_plan = {
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(output_layouts=seq),
            "mlp.up": ColwiseParallel(use_local_output=False),
            "mlp.down": RowwiseParallel(output_layouts=seq),
        }
        if sp:
            block_plan |= {"norm1": SequenceParallel(), "norm2": SequenceParallel()}
            block_plan |= {"attn": gather, "mlp": gather}
        parallelize_module(block, tp_mesh, block_plan)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


_MESH: list = []
_FAILED = [False]


def mesh_3d():
    """The ``("pp", "dp", "tp")`` mesh, its Gloo groups waiting ``TIMEOUT_S`` at most; made
    once (again after a failed spec, decided by one world all-reduce: a world collective)."""
    again = torch.tensor([int(_FAILED[0] or not _MESH)])
    dist.all_reduce(again, op=dist.ReduceOp.MAX)
    if again.item():
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=TIMEOUT_S)
        names = ("pp", "dp", "tp")
        _MESH[:] = [
            init_device_mesh(
                "cpu",
                (PP, DP, TP),
                mesh_dim_names=names,
                backend_override={n: ("gloo", opts) for n in names},
            )
        ]
        _FAILED[0] = False
    return _MESH[0]


def global_batch(step: int, n_mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    shape = (DP * n_mb * ROWS, SEQ)
    return torch.randint(VOCAB, shape, generator=g), torch.randint(VOCAB, shape, generator=g)


def reference_loss(ref: nn.Module, x: torch.Tensor, y: torch.Tensor, n_mb: int):
    """The mean of the ``DP * n_mb`` microbatch losses (see pipeline_cases.reference_loss)."""
    chunks = DP * n_mb
    pairs = zip(x.chunk(chunks), y.chunk(chunks), strict=True)
    return sum(loss_fn(ref(xm), ym) for xm, ym in pairs) / chunks


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)
    return err if err == err else float("inf")


def stage_ids(pp_rank: int, per_rank: int, style: str) -> list[int]:
    if style == "v":
        return [pp_rank, 2 * PP - 1 - pp_rank]
    return [pp_rank + k * PP for k in range(per_rank)]


class Run3D:
    """One spec on this rank: its stages (TP, then flatshard), the schedule, the reference."""

    def __init__(self, spec: dict) -> None:
        cls, per_rank, style = SCHEDULES[spec["schedule"]]
        self.n_mb, self.n_stages = spec["microbatches"], PP * per_rank
        mesh = mesh_3d()
        self.pp_mesh = mesh["pp"]
        self.dp_rank = mesh["dp"].get_local_rank()
        self.ids = stage_ids(self.pp_mesh.get_local_rank(), per_rank, style)
        whole = build_stages(self.n_stages)
        self.ref = nn.Sequential(*copy.deepcopy(whole))
        self.mine = [whole[i] for i in self.ids]
        shard_over = mesh["dp", "tp"] if spec.get("whole_mesh") else mesh["dp"]
        for module in self.mine:
            parallelize_stage(module, mesh["tp"], sp=spec["sp"])
            fs.shard(module, policy=fs.wrap.by_type(Block), mesh=shard_over, timeout_s=TIMEOUT_S)
        self.schedule = make_schedule(cls, self, self.pp_mesh.get_group(), loss_fn)
        self.opt = OPTIMIZERS[spec["optim"]]([p for m in self.mine for p in m.parameters()])
        self.ref_opt = OPTIMIZERS[spec["optim"]](self.ref.parameters())
        self.norm_err = 0.0

    def step(self, step: int) -> None:
        x, y = global_batch(step, self.n_mb)
        mine = slice(self.dp_rank * self.n_mb * ROWS, (self.dp_rank + 1) * self.n_mb * ROWS)
        args = (x[mine],) if 0 in self.ids else ()
        target = y[mine] if self.n_stages - 1 in self.ids else None
        with fs.pipeline_step(self.schedule):
            self.schedule.step(*args, target=target)
        norm = fs.clip_grad_norm_(self.mine, MAX_NORM, across=self.pp_mesh).item()
        reference_loss(self.ref, x, y, self.n_mb).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(self.ref.parameters(), MAX_NORM).item()
        self.norm_err = max(self.norm_err, abs(norm - ref_norm) / ref_norm)
        for opt in (self.opt, self.ref_opt):
            opt.step()
            opt.zero_grad()

    def result(self) -> dict:
        """The worst error over the stages whose full state this rank holds."""
        out = {"err": 0.0, "worst": "", "held": [], "norm_err": self.norm_err}
        for module, i in zip(self.mine, self.ids, strict=True):
            full = fs.full_state_dict(module)
            if not full:
                continue
            out["held"].append(i)
            for key, value in self.ref[i].state_dict().items():
                if (err := rel_err(full[key], value)) >= out["err"]:
                    out["err"], out["worst"] = err, f"stage {i} {key}"
        return out


def run_spec(spec: dict) -> dict:
    run = Run3D(spec)
    for step in range(STEPS):
        run.step(step)
    return run.result()


def case_3d(specs: list[dict]) -> list[dict]:
    """Each spec on every rank: this rank's result, or the error it raised (not re-raised:
    every wait times out within ``TIMEOUT_S``, and the next spec still runs)."""
    from pipeline_cases import run_each

    return run_each(specs, run_spec, _FAILED)


def merge(spec: dict, per_rank: list[dict]) -> dict:
    errors = [f"rank {r}: {o['error']}" for r, o in enumerate(per_rank) if "error" in o]
    if errors:
        return {**spec, "error": errors[0]}
    worst = max(per_rank, key=lambda r: r["err"])
    return {
        **spec,
        "err": worst["err"],
        "worst": worst["worst"],
        "held": sorted({i for r in per_rank for i in r["held"]}),
        "holders": [rank for rank, r in enumerate(per_rank) if r["held"]],
        "norm_err": max(r["norm_err"] for r in per_rank),
        "seconds": max(r["seconds"] for r in per_rank),
    }
