"""Tensor-parallel copies tied across stages: the cases behind test_pipeline_tied.py's pp x tp.

World 4 = pp 2 x dp 1 x tp 2 on one mesh ``("pp", "dp", "tp")`` (the trainer's layout at
``--parallelism.pp 2 --parallelism.tp 2``). The model is ``pipeline_3d_cases``'s (float64,
embedding + blocks on the first stage, blocks + norm + head on the last) with the head's
weight a copy of the embedding's; each stage is made tensor-parallel by torchtitan's plan
(``parallelize_stage``: the embedding rowwise and the head colwise, both ``Shard(0)``;
sequence parallel), sharded by ``fs.shard`` over ``mesh["dp"]`` and driven inside
``fs.pipeline_step``; ``fs.tie_across_stages`` declares the pair. The reference is one process
training the whole model with the two *tied* (one parameter) on the global batch. Per step,
every rank reports: its schedule's loss (last stage), the largest error of every local
gradient block against the reference's gradient (tied copies included), and the global value
of each copy it holds; at the end, every stage's full state against the reference's.
"""

from __future__ import annotations

import copy
import datetime

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import flatshard as fs
from pipeline_3d_cases import (
    SCHEDULES,
    Block,
    build_stages,
    loss_fn,
    parallelize_stage,
    rel_err,
    stage_ids,
)
from pipeline_cases import make_schedule, run_each
from tp_cases import OPTIMIZERS, SEQ, VOCAB

PP, DP, TP = 2, 1, 2
STEPS = 3
TIMEOUT_S = 30
TIES = "embed.weight", "head.weight"
_MESH: list = []
_FAILED = [False]


def mesh_pp_tp():
    """The ``("pp", "dp", "tp")`` mesh of shape (2, 1, 2), Gloo groups waiting ``TIMEOUT_S``;
    made once (again after a failed spec, decided by one world all-reduce)."""
    again = torch.tensor([int(_FAILED[0] or not _MESH)])
    dist.all_reduce(again, op=dist.ReduceOp.MAX)
    if again.item():
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=TIMEOUT_S)
        names = ("pp", "dp", "tp")
        overrides = {n: ("gloo", opts) for n in names}
        _MESH[:] = [
            init_device_mesh("cpu", (PP, DP, TP), mesh_dim_names=names, backend_override=overrides)
        ]
        _FAILED[0] = False
    return _MESH[0]


def tied_stages(n_stages: int) -> tuple[list, nn.Sequential]:
    """The stages (head weight = a copy of the embedding's) and the tied reference."""
    whole = build_stages(n_stages)
    with torch.no_grad():
        whole[-1].head.weight.copy_(whole[0].embed.weight)
    ref = nn.Sequential(*copy.deepcopy(whole))
    ref[-1].head.weight = ref[0].embed.weight  # one parameter: the single process's model
    return whole, ref


def global_batch(step: int, n_mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    shape = (n_mb, SEQ)  # one row per microbatch; dp 1: every rank's batch is the global one
    return torch.randint(VOCAB, shape, generator=g), torch.randint(VOCAB, shape, generator=g)


def _block(full: torch.Tensor, origin: tuple, shape: torch.Size) -> torch.Tensor:
    """The block of ``full`` at ``origin`` of ``shape`` (a tp rank's part of a parameter)."""
    for dim, (start, size) in enumerate(zip(origin, shape, strict=True)):
        full = full.narrow(dim, start, size)
    return full


class TiedTPRun:
    """One spec on this rank."""

    def __init__(self, spec: dict) -> None:
        cls, per_rank, style = SCHEDULES[spec["schedule"]]
        self.n_mb, self.n_stages, self.spec = spec["microbatches"], PP * per_rank, spec
        mesh = mesh_pp_tp()
        self.pp_mesh = mesh["pp"]
        self.ids = stage_ids(self.pp_mesh.get_local_rank(), per_rank, style)
        whole, self.ref = tied_stages(self.n_stages)
        self.mine = [whole[i] for i in self.ids]
        for module in self.mine:
            parallelize_stage(module, mesh["tp"], sp=True)
            fs.shard(module, policy=fs.wrap.by_type(Block), mesh=mesh["dp"], timeout_s=TIMEOUT_S)
        self.schedule = make_schedule(cls, self, self.pp_mesh.get_group(), loss_fn)
        if spec.get("tie", True):
            fs.tie_across_stages(self.schedule, [{0: TIES[0], self.n_stages - 1: TIES[1]}])
        self.opt = OPTIMIZERS[spec["optim"]]([p for m in self.mine for p in m.parameters()])
        self.ref_opt = OPTIMIZERS[spec["optim"]](self.ref.parameters())
        self.out: dict = {"loss_err": 0.0, "grad_err": 0.0, "grad_worst": "", "copies": []}

    def step(self, step: int) -> None:
        x, y = global_batch(step, self.n_mb)
        last = self.n_stages - 1 in self.ids
        losses: list = []
        with fs.pipeline_step(self.schedule):
            self.schedule.step(
                *((x,) if 0 in self.ids else ()), target=y if last else None, losses=losses
            )
        pairs = zip(x.chunk(self.n_mb), y.chunk(self.n_mb), strict=True)
        ref_loss = sum(loss_fn(self.ref(xm), ym) for xm, ym in pairs) / self.n_mb
        ref_loss.backward()
        if last:
            loss = sum(v.item() for v in losses) / self.n_mb
            self.out["loss_err"] = max(self.out["loss_err"], abs(loss - ref_loss.item()))
        self._check_grads()
        for opt in (self.opt, self.ref_opt):
            opt.step()
            opt.zero_grad()
        self.out["copies"].append(self._copies())

    def _check_grads(self) -> None:
        """Every local gradient block against the reference's gradient at its place."""
        for module, i in zip(self.mine, self.ids, strict=True):
            for name, info in fs.fragment_info(module).items():
                want = self.ref[i].get_parameter(name).grad
                if info.fragment.grad is None:
                    continue  # an unused parameter (none here: every one is used)
                local = _block(want, info.origin, info.full_shape).reshape(-1)
                got = info.fragment.grad
                err = rel_err(got, local[info.flat_range[0] : info.flat_range[1]])
                if err >= self.out["grad_err"]:
                    self.out["grad_err"], self.out["grad_worst"] = err, f"stage {i} {name}"

    def _copies(self) -> list[torch.Tensor]:
        """The global value of each tied copy this rank holds (collectives over dp and tp)."""
        held = []
        for module in self.mine:
            with fs.summon_full_params(module, writeback=False):
                for name in TIES:
                    if (param := dict(module.named_parameters()).get(name)) is not None:
                        value = param.full_tensor() if isinstance(param, DTensor) else param
                        held.append(value.detach().clone())
        return held

    def result(self) -> dict:
        err, worst = 0.0, ""
        for module, i in zip(self.mine, self.ids, strict=True):
            full = fs.full_state_dict(module)
            for key, value in self.ref[i].state_dict().items() if full else ():
                if (e := rel_err(full[key], value)) >= err:
                    err, worst = e, f"stage {i} {key}"
        return {**self.out, "err": err, "worst": worst}


def run_spec(spec: dict) -> dict:
    run = TiedTPRun(spec)
    for step in range(STEPS):
        run.step(step)
    return run.result()


def case_tied_tp(specs: list[dict]) -> list[dict]:
    """Each spec on every rank: this rank's result, or the error it raised."""
    return run_each(specs, run_spec, _FAILED)


def merge(spec: dict, per_rank: list[dict]) -> dict:
    """Over the ranks: the worst errors, and per step the largest difference between any two
    copies (every copy on every rank)."""
    errors = [f"rank {r}: {o['error']}" for r, o in enumerate(per_rank) if "error" in o]
    if errors:
        return {**spec, "error": errors[0]}
    spreads = []
    for step in range(STEPS):
        copies = [c for r in per_rank for c in r["copies"][step]]
        spreads.append(max((c - copies[0]).abs().max().item() for c in copies))
    worst = max(per_rank, key=lambda r: r["err"])
    grad = max(per_rank, key=lambda r: r["grad_err"])
    return {
        **spec,
        "err": worst["err"],
        "worst": worst["worst"],
        "grad_err": grad["grad_err"],
        "grad_worst": grad["grad_worst"],
        "loss_err": max(r["loss_err"] for r in per_rank),
        "copies": sum(len(r["copies"][0]) for r in per_rank),
        "copy_spread": spreads,
    }


def case_tp_errors() -> dict[str, str]:
    """What bad declarations of tensor-parallel copies raise on this rank (1F1B, pp 2)."""
    out = {}
    for name in ("embedding_shard_1", "one_tp_block_differs"):
        try:
            _declare(name)
            out[name] = "no error"
        except ValueError as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        dist.barrier()  # the test's own sync between cases
    return out


def _declare(case: str) -> None:
    mesh = mesh_pp_tp()
    pp = mesh["pp"].get_local_rank()
    whole, _ = tied_stages(PP)
    module = whole[pp]
    embed = module.embed
    if case == "embedding_shard_1" and embed is not None:
        module.embed = None  # the rest of the stage as parallelize_stage makes it
    parallelize_stage(module, mesh["tp"], sp=True)
    if module.embed is None and embed is not None:
        # colwise on an embedding splits d_model: Shard(1), while the head is Shard(0)
        module.embed = parallelize_module(embed, mesh["tp"], ColwiseParallel())
    tp_rank = mesh["tp"].get_local_rank()
    if case == "one_tp_block_differs" and module.head is not None and tp_rank == 1:
        with torch.no_grad():  # only tp rank 1's block of the head
            module.head.weight.to_local()[0, 0] += 1.0
    fs.shard(module, policy=fs.wrap.by_type(Block), mesh=mesh["dp"], timeout_s=TIMEOUT_S)
    stage = PipelineStage(module, pp, PP, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = torch_schedules.Schedule1F1B(stage, n_microbatches=2, loss_fn=loss_fn)
    fs.tie_across_stages(schedule, [{0: TIES[0], PP - 1: TIES[1]}])
