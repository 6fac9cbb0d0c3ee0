"""A tied embedding and head split over pipeline stages: the cases behind test_pipeline_tied.py.

World 4 = pp 2 x dp 2, the model of ``pipeline_cases.py`` (embedding on the first stage,
head on the last, each ``Linear(DIM, VOCAB)`` / ``Embedding(VOCAB, DIM)`` weight of shape
``[VOCAB, DIM]``) with the head's weight a copy of the embedding's. The reference is one
process training the same model with the two *tied* (one parameter) on the global batch.
Each stage is sharded over dp by flatshard (the embedding lives in the first stage's root
unit, the head in the last stage's: two flat layouts); ``fs.tie_across_stages`` declares the
pair. Reported per spec: the worst error of every stage's full state against the reference,
the largest difference between the copies (every copy, gathered on every rank), and the
whole-model gradient norm's error (``fs.clip_grad_norm_(..., across=pp)``, measured only).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

import flatshard as fs
from flatshard.parallel.pipeline_tied import tie_across_stages
from pipeline_cases import (
    _FAILED,
    OPTIMIZERS,
    PP,
    SCHEDULES,
    STEPS,
    TIMEOUT_S,
    Block,
    Stage,
    build_stages,
    global_batch,
    loss_fn,
    meshes,
    reference_loss,
    rel_err,
    run_each,
    stage_ids,
)


def tied_model(n_stages: int, misalign: bool = False) -> tuple[list[Stage], nn.Sequential]:
    """The stages (head weight = a copy of the embedding's) and the tied reference.
    ``misalign``: an (unused) parameter of 8 elements ahead of the head in the last stage's
    flat layout, so that the dp split falls elsewhere in the head's weight than in the
    embedding's."""
    whole = build_stages(n_stages)
    with torch.no_grad():
        whole[-1].head.weight.copy_(whole[0].embed.weight)
    if misalign:
        whole[-1].norm.register_parameter("pad", nn.Parameter(torch.zeros(8)))
    ref = nn.Sequential(*copy.deepcopy(whole))
    ref[-1].head.weight = ref[0].embed.weight  # one parameter: the single process's model
    return whole, ref


def tied_copy(module: Stage) -> list[torch.Tensor]:
    """The whole value of each tied copy ``module`` holds (a collective over its dp mesh)."""
    with fs.summon_full_params(module, writeback=False):
        held = [m.weight for m in (module.embed, module.head) if m is not None]
        return [w.detach().clone() for w in held]


class TiedRun:
    """One spec on this rank."""

    def __init__(self, spec: dict) -> None:
        cls, per_rank, style = SCHEDULES[spec["schedule"]]
        self.n_mb, self.n_stages = spec["microbatches"], PP * per_rank
        self.pp_mesh, self.dp_mesh = meshes()
        self.dp_rank = self.dp_mesh.get_local_rank()
        self.ids = stage_ids(self.pp_mesh.get_local_rank(), per_rank, style)
        whole, self.ref = tied_model(self.n_stages, spec.get("misalign", False))
        self.mine = [whole[i] for i in self.ids]
        for module in self.mine:
            fs.shard(module, policy=fs.wrap.by_type(Block), mesh=self.dp_mesh, timeout_s=TIMEOUT_S)
        group = self.pp_mesh.get_group()
        stages = [
            PipelineStage(m, i, self.n_stages, torch.device("cpu"), group=group)
            for m, i in zip(self.mine, self.ids, strict=True)
        ]
        single = issubclass(cls, torch_schedules.PipelineScheduleSingle)
        self.schedule = cls(
            stages[0] if single else stages, n_microbatches=self.n_mb, loss_fn=loss_fn
        )
        if spec.get("tie", True):
            tie_across_stages(
                self.schedule, [{0: "embed.weight", self.n_stages - 1: "head.weight"}]
            )
        self.opt = OPTIMIZERS[spec["optim"]]([p for m in self.mine for p in m.parameters()])
        self.ref_opt = OPTIMIZERS[spec["optim"]](self.ref.parameters())
        self.norm_err = 0.0

    def step(self, step: int) -> None:
        x, y = global_batch(step, self.n_mb)
        args = (x.chunk(2)[self.dp_rank],) if 0 in self.ids else ()
        last = self.n_stages - 1 in self.ids
        with fs.pipeline_step(self.schedule):
            self.schedule.step(*args, target=y.chunk(2)[self.dp_rank] if last else None)
        reference_loss(self.ref, x, y, self.n_mb).backward()
        norm = fs.clip_grad_norm_(self.mine, 1e9, across=self.pp_mesh).item()
        ref_norm = torch.nn.utils.clip_grad_norm_(self.ref.parameters(), 1e9).item()
        self.norm_err = max(self.norm_err, abs(norm - ref_norm) / ref_norm)
        for opt in (self.opt, self.ref_opt):
            opt.step()
            opt.zero_grad()

    def result(self) -> dict:
        err, worst = 0.0, ""
        for module, i in zip(self.mine, self.ids, strict=True):
            full = fs.full_state_dict(module)
            for key, value in self.ref[i].state_dict().items() if full else ():
                if (e := rel_err(full[key], value)) >= err:
                    err, worst = e, f"stage {i} {key}"
        copies = [c for module in self.mine for c in tied_copy(module)]
        ranges = {  # where this rank's fragment of each copy lies in the whole weight
            name: info.flat_range
            for module in self.mine
            for name, info in fs.fragment_info(module).items()
            if name in ("embed.weight", "head.weight")
        }
        return {
            "err": err,
            "worst": worst,
            "copies": copies,
            "ranges": ranges,
            "norm_err": self.norm_err,
        }


def run_spec(spec: dict) -> dict:
    run = TiedRun(spec)
    for step in range(STEPS):
        run.step(step)
    return run.result()


def case_tied(specs: list[dict]) -> list[dict]:
    """Each spec on every rank: this rank's result (with the copies it holds), or the error."""
    return run_each(specs, run_spec, _FAILED)


def merge(spec: dict, per_rank: list[dict]) -> dict:
    """Over the ranks: the worst error, and the largest difference between any two copies."""
    errors = [r["error"] for r in per_rank if "error" in r]
    if errors:
        return {**spec, "error": errors[0]}
    copies = [c for r in per_rank for c in r["copies"]]
    spread = max((c - copies[0]).abs().max().item() for c in copies)
    worst = max(per_rank, key=lambda r: r["err"])
    return {
        **spec,
        "err": worst["err"],
        "worst": worst["worst"],
        "copies": len(copies),
        "copy_spread": spread,
        "ranges": {
            name: sorted(r["ranges"][name] for r in per_rank if name in r["ranges"])
            for name in ("embed.weight", "head.weight")
        },
        "norm_err": max(r["norm_err"] for r in per_rank),
    }


def case_errors() -> dict[str, str]:
    """What bad declarations raise, by case, on this rank (every rank runs every case)."""
    pp_mesh, dp_mesh = meshes()
    out = {}
    cases = {
        "missing_name": ([{0: "embed.weight", 1: "head.nope"}], False),
        "unequal_values": ([{0: "embed.weight", 1: "head.weight"}], True),
        "stage_out_of_range": ([{0: "embed.weight", 7: "head.weight"}], False),
        "not_a_list": ({0: "embed.weight", 1: "head.weight"}, False),
        "shape_mismatch": ([{0: "embed.weight", 1: "blocks.0.b.weight"}], False),
    }
    for name, (ties, perturb) in cases.items():
        try:
            _declare(ties, perturb, pp_mesh, dp_mesh)
            out[name] = "no error"
        except (TypeError, ValueError, NotImplementedError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        dist.barrier()  # the test's own sync between cases (the world: the test's ranks)
    return out


def _declare(ties, perturb: bool, pp_mesh, dp_mesh) -> None:
    pp = pp_mesh.get_local_rank()
    whole, _ = tied_model(PP)
    module = whole[pp]
    if perturb and module.head is not None:
        with torch.no_grad():
            module.head.weight[0, 0] += 1.0
    fs.shard(module, policy=fs.wrap.by_type(Block), mesh=dp_mesh, timeout_s=TIMEOUT_S)
    stage = PipelineStage(module, pp, PP, torch.device("cpu"), group=pp_mesh.get_group())
    schedule = torch_schedules.Schedule1F1B(stage, n_microbatches=2, loss_fn=loss_fn)
    tie_across_stages(schedule, ties)
