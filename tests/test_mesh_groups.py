"""A sharded model talks only to the ranks of its own mesh (world 4, Gloo).

Two different models live in one job on disjoint halves of the world: job 0 (ranks 0, 1)
trains a tied TinyGPT with ``full_shard`` over a 1-D mesh; job 1 (ranks 2, 3) trains another
model with ``hybrid_shard`` over a 2-D (replicate 1, shard 2) slice of a 3-D mesh, which makes
flatshard build a group over that slice alone. They take different numbers of steps, save
(sync and async), load, export full state dicts and clip, each at its own pace: any collective
on the world group would pair ranks of different jobs and hang or mix them. Each model must
equal single-process training on its own job's global batch, and "rank 0" of the model-level
helpers is the mesh's first rank (global rank 2 for job 1).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import flatshard as fs
from parity_models import CASES, rel_err

TOLERANCE = 1e-6  # SGD with momentum, fp32
JOBS = {  # job -> (case, strategy, steps)
    0: ("gpt_tied", "full_shard", 3),
    1: ("unused", "hybrid_shard", 5),
}


def _job_mesh(strategy: str):
    """This rank's mesh: 1-D over its job's two ranks, or a (replicate, shard) slice. Every
    rank makes both meshes, as a job makes all of its meshes up front: making a DeviceMesh
    is a collective of the whole world (only what a model does afterwards is its own)."""
    flat = init_device_mesh("cpu", (2, 2), mesh_dim_names=("job", "dp"))
    nested = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("job", "replicate", "shard"))
    return nested["replicate", "shard"] if strategy == "hybrid_shard" else flat["dp"]


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _build(name: str, strategy: str, mesh) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    ref = CASES[name].build()
    model = copy.deepcopy(ref)
    fs.shard(model, policy=CASES[name].policy(), strategy=strategy, mesh=mesh)
    return model, ref


def _train(model, ref, name: str, steps: int, job_rank: int) -> float:
    """``steps`` SGD steps, this rank on its half of the job's batch; the worst gradient
    error (every step) against the reference on the whole batch."""
    case, opt, ref_opt = CASES[name], _sgd(model), _sgd(ref)
    scaler = fs.GradScaler()  # its found-inf all-reduce must stay on the model's mesh
    worst = 0.0
    for step in range(steps):
        batch = case.batch(torch.Generator().manual_seed(step), 4)
        scaler.scale(case.loss(model, batch.chunk(2)[job_rank])).backward()
        case.loss(ref, batch).backward()
        scaler.unscale_(opt)
        norm = fs.clip_grad_norm_(model, 1e9)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
        worst = max(worst, rel_err(norm, ref_norm))
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            if p.grad is not None and p.numel():
                lo, hi = fs.fragment_info(model)[_name_of(model, p)].flat_range
                worst = max(worst, rel_err(p.grad, q.grad.reshape(-1)[lo:hi]))
        scaler.step(opt), scaler.update(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    return worst


def _name_of(model: torch.nn.Module, param: torch.Tensor) -> str:
    return next(n for n, p in model.named_parameters() if p is param)


def _sd_err(full: dict, ref: torch.nn.Module) -> float:
    return max(rel_err(full[k], v) for k, v in ref.state_dict().items())


def case_disjoint_jobs(root: str) -> dict:
    """Per rank: gradient, state-dict and reload errors of its job's model, and who held
    the full state dict."""
    rank = dist.get_rank()
    job, job_rank = rank // 2, rank % 2
    name, strategy, steps = JOBS[job]
    mesh = _job_mesh(strategy)
    model, ref = _build(name, strategy, mesh)
    grad_err = _train(model, ref, name, steps, job_rank)
    full = fs.full_state_dict(model)
    out = dict(job=job, grad_err=grad_err, holds_full=bool(full))
    out["sd_err"] = _sd_err(full, ref) if full else 0.0
    path = f"{root}/job{job}"
    fs.save(path, model=model, extra={"job": job, "steps": steps})
    fs.save(f"{path}-async", model=model, async_=True).wait()
    for where in (path, f"{path}-async"):
        fresh, _ = _build(name, strategy, mesh)
        extra = fs.load(where, model=fresh)
        reloaded = fs.full_state_dict(fresh)
        out[f"reload_err {where[-6:]}"] = _sd_err(reloaded, ref) if reloaded else 0.0
        out["extra_ok"] = where.endswith("async") or extra == {"job": job, "steps": steps}
    fresh, _ = _build(name, strategy, mesh)
    fs.load_full_state_dict(fresh, ref.state_dict() if full else {})
    again = fs.full_state_dict(fresh)
    out["load_full_err"] = _sd_err(again, ref) if again else 0.0
    return out


def test_models_on_disjoint_meshes_train_save_and_load_independently(dist_pools, tmp_path):
    results = dist_pools(4).run(case_disjoint_jobs, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["holds_full"] == (rank % 2 == 0), f"rank {rank}: the mesh's first rank holds it"
        errors = {k: v for k, v in r.items() if k.endswith("_err") or k.startswith("reload")}
        assert all(v <= TOLERANCE for v in errors.values()), f"rank {rank}: {errors}"
        assert r["extra_ok"], f"rank {rank}: the saved extra did not come back"


def case_mismatch_in_one_job() -> str:
    """Job 0's ranks build different models; job 1 shards the same model on both ranks."""
    rank = dist.get_rank()
    mesh = _job_mesh("full_shard")
    name = "lora" if rank == 1 else "gpt_tied"
    try:
        _build(name, "full_shard", mesh)
    except ValueError as err:
        return str(err)
    return "sharded"


def test_a_mismatch_inside_one_mesh_fails_on_its_ranks_only(dist_pools):
    results = dist_pools(4).run(case_mismatch_in_one_job)
    assert all("ranks disagree on the model" in r for r in results[:2]), results[:2]
    assert results[2:] == ["sharded", "sharded"]
