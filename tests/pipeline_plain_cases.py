"""torchtitan's pipeline recipe, unchanged: the cases behind tests/test_pipeline_plain.py.

World 4 = pp 2 x dp 2, the model, stages, meshes and reference of ``pipeline_cases.py``. Each
stage is ``fs.shard``-ed over its dp mesh and wrapped in a ``PipelineStage``; every step calls
``schedule.step(...)`` plainly (``mode="plain"``) or inside ``fs.pipeline_step`` (``"explicit"``).
After ``STEPS`` SGD-with-momentum steps every rank's own fragments are compared with the same
elements of a single process trained on the global batch, and each step's reduce-scatters per
reduction (``fs.comm_stats``) are recorded.

``custom_reduce=True`` registers a custom ``REDUCE_GRAD`` action function on the schedule (it
does what torch's does): flatshard cannot follow such a schedule, so a plain step falls back
(a full backward reduces per microbatch, a split one is refused at the first optimizer step).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.pipelining import schedules as torch_schedules

import flatshard as fs
from pipeline_cases import _FAILED, DP, Run, global_batch, reductions, reference_loss, run_each
from pipeline_tied_cases import TiedRun

STEPS = 2


def register_custom_reduce(schedule) -> None:
    """A ``REDUCE_GRAD`` action function equal to torch's own (a real API of the runtime)."""
    stages = {s.stage_index: s for s in schedule._stages}
    factor = schedule._n_microbatches if schedule.scale_grads else 1

    def reduce_grad(action, ctx) -> None:
        stages[action.stage_index].perform_reduce_grad(factor)

    schedule.register_custom_function(torch_schedules.REDUCE_GRAD, reduce_grad)


def one_step(run: Run, step: int, plain: bool) -> list[float]:
    """One optimizer step of the stages and the reference; per stage, reduce-scatters per
    reduction of this step."""
    x, y = global_batch(step, run.n_mb)
    for module in run.mine:
        fs.comm_stats(module, reset=True)
    args = (x.chunk(DP)[run.dp_rank],) if 0 in run.ids else ()
    target = y.chunk(DP)[run.dp_rank] if run.n_stages - 1 in run.ids else None
    if plain:
        run.schedule.step(*args, target=target)
    else:
        with fs.pipeline_step(run.schedule):
            run.schedule.step(*args, target=target)
    counts = [fs.comm_stats(m).calls["reduce_scatter"] / reductions(m) for m in run.mine]
    reference_loss(run.ref, x, y, run.n_mb).backward()
    for opt in (run.opt, run.ref_opt):
        opt.step()
        opt.zero_grad()
    return counts


def eval_step(run: Run) -> None:
    """``schedule.eval``: forwards only (the loss too), no backward, no reduction."""
    x, y = global_batch(99, run.n_mb)
    args = (x.chunk(DP)[run.dp_rank],) if 0 in run.ids else ()
    target = y.chunk(DP)[run.dp_rank] if run.n_stages - 1 in run.ids else None
    run.schedule.eval(*args, target=target)


def fragment_error(run: Run) -> tuple[float, str]:
    """The worst difference between this rank's fragments and the same elements of the
    reference, relative to the whole reference parameter's largest element."""
    worst, where = 0.0, ""
    for module, i in zip(run.mine, run.ids, strict=True):
        ref = dict(run.ref[i].named_parameters())
        for name, info in fs.fragment_info(module).items():
            start, end = info.flat_range
            if start == end:
                continue  # this rank holds none of it
            whole = ref[name].detach().reshape(-1)
            diff = (info.fragment.detach() - whole[start:end]).abs().max().item()
            err = diff / max(whole.abs().max().item(), 1e-12)
            err = float("inf") if math.isnan(err) else err
            if err >= worst:
                worst, where = err, f"stage {i} {name}"
    return worst, where


def run_plain(spec: dict) -> dict:
    run = Run({**spec, "engine": "flatshard_plain", "optim": "sgd"})
    if spec.get("custom_reduce"):
        register_custom_reduce(run.schedule)
    counts = []
    for step in range(STEPS):
        if step and spec.get("eval_between"):  # a forward-only step between training steps
            eval_step(run)
        counts.append(one_step(run, step, spec["mode"] == "plain"))
    err, worst = fragment_error(run)
    return {"err": err, "worst": worst, "rs": counts}


def run_tied_plain(spec: dict) -> dict:
    """One plain step and optimizer step of ``pipeline_tied_cases``' tied embedding and head
    (declared with ``fs.tie_across_stages``): refused, only ``fs.pipeline_step`` sums ties."""
    run = TiedRun({**spec, "optim": "sgd"})
    x, y = global_batch(0, run.n_mb)
    args = (x.chunk(DP)[run.dp_rank],) if 0 in run.ids else ()
    target = y.chunk(DP)[run.dp_rank] if run.n_stages - 1 in run.ids else None
    run.schedule.step(*args, target=target)
    run.opt.step()
    return {}


def case_tied_plain(specs: list[dict]) -> list[dict]:
    return run_each(specs, run_tied_plain, _FAILED)


def case_plain(specs: list[dict]) -> list[dict]:
    """Each spec on every rank: this rank's result, or the error it raised."""
    torch.manual_seed(0)
    return run_each(specs, run_plain, _FAILED)
