"""``fs.pipeline_step(schedule, keep_gathered=True)``: the cases behind test_pipeline_keep.py.

The model, meshes, stages and reference of ``pipeline_cases.py`` (world 4 = pp 2 x dp 2),
run by its ``Run`` with two things swapped in for the duration of a spec: ``fs.shard`` with
the spec's variant's options (mixed precision, a strategy, buckets, offload, activation
checkpointing, no gather pool) and ``fs.pipeline_step`` with the spec's ``keep`` flag, spied
on just before its block ends (every unit gathered? any buffer shared by two units?). Per
spec and rank: the worst error against the single process (``Run.compare``), the all-gathers
and reduce-scatters of the last step per stage against the stage's gathered groups and
reductions, what the spy saw, whether every unit is released after the step, and this rank's
fragments (the test compares keep and no-keep runs bit for bit).
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.distributed.device_mesh import init_device_mesh

import flatshard as fs
import pipeline_cases
from flatshard.core.state import get_state
from flatshard.core.unit import ParamState
from pipeline_cases import _FAILED, DP, PP, STEPS, Block, Run, reductions, run_each

BF16 = fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# variant -> fs.shard keyword arguments (the policy and mesh are Run's; coalesce=False unless
# the variant says otherwise)
VARIANTS: dict[str, dict] = {
    "full_shard": {},
    "bf16": {"mixed_precision": BF16},
    "shard_grad_op": {"strategy": "shard_grad_op"},
    "no_shard": {"strategy": "no_shard"},
    "coalesce": {"coalesce": True},
    "offload": {"offload": fs.CPUOffload()},
    "hybrid_shard": {"strategy": "hybrid_shard"},  # on a (replicate 1, shard 2) mesh of dp
    "checkpoint": {},  # fs.checkpoint_activations on every Block, after fs.shard
    "no_pool": {},  # FLATSHARD_GATHER_POOL=0: private buffers
}
_SEEN: list[dict] = []  # what the spy saw inside each block of the spec running now
_HYBRID: list = []  # the (replicate, shard) mesh of this rank's dp ranks, made once


def _hybrid_mesh():
    """dp as a 2-D (replicate 1, shard 2) mesh: a world collective, made once per worker."""
    if not _HYBRID:
        mesh = init_device_mesh("cpu", (PP, 1, DP), mesh_dim_names=("pp", "rep", "shard"))
        _HYBRID.append(mesh["rep", "shard"])
    return _HYBRID[0]


def _prepare(variant: str, kwargs: dict) -> dict:
    """The variant's ``fs.shard`` arguments (a reentrant checkpoint is no variant: torch's
    stage backward passes ``inputs=``, which it refuses, with or without flatshard)."""
    if variant == "hybrid_shard":
        kwargs = {**kwargs, "mesh": _hybrid_mesh()}
    # Unbucketed by default: the blocks are tiny, and buckets keep private buffers, so only
    # unbucketed blocks borrow from the gather pool.
    return {**kwargs, "coalesce": False, **VARIANTS[variant]}


@contextmanager
def _swapped(variant: str, keep: bool) -> Iterator[None]:
    """``fs.shard`` with the variant's options and ``fs.pipeline_step`` with ``keep``, as the
    cases see them (``pipeline_cases`` calls both through ``fs``), until the spec ends."""
    shard, step, stats = fs.shard, fs.pipeline_step, fs.comm_stats

    def shard_variant(module, **kwargs):
        out = shard(module, **_prepare(variant, kwargs))
        if variant == "checkpoint":
            fs.checkpoint_activations(out, fs.wrap.by_type(Block))
        return out

    @contextmanager
    def step_spied(schedule):
        with step(schedule, keep_gathered=keep):
            yield
            _SEEN.append(_inside(schedule))

    env = os.environ.get("FLATSHARD_GATHER_POOL")
    if variant == "no_pool":
        os.environ["FLATSHARD_GATHER_POOL"] = "0"

    def stats_counted(module, *, reset: bool = False):  # no_shard issues no reduce-scatter
        out = stats(module, reset=reset)
        return dataclasses.replace(out, calls=Counter(out.calls))

    swapped = (shard_variant, step_spied, stats_counted)
    fs.shard, fs.pipeline_step, fs.comm_stats = swapped  # type: ignore[assignment]
    try:
        yield
    finally:
        fs.shard, fs.pipeline_step, fs.comm_stats = shard, step, stats  # type: ignore[assignment]
        if variant == "no_pool":
            os.environ.pop("FLATSHARD_GATHER_POOL")
            if env is not None:
                os.environ["FLATSHARD_GATHER_POOL"] = env


def _inside(schedule) -> dict:
    """Just before the block ends: units not gathered, and buffers two gathered groups share."""
    from flatshard.parallel.pipeline_checks import schedule_stages

    units = [u for s in schedule_stages(schedule) for u in get_state(s.submod).units]
    groups = [g for u in units if u.state is ParamState.UNSHARDED for g in u.groups]
    ptrs = [g.full.untyped_storage().data_ptr() for g in groups if not g.replicated]
    released = sum(u.state is ParamState.SHARDED for u in units)
    return {"released": released, "shared": len(ptrs) - len(set(ptrs))}


def _gathered_groups(module) -> int:
    """The groups a step gathers: every group that is not the shard itself."""
    return sum(1 for u in get_state(module).units for g in u.groups if not g.replicated)


def run_keep(spec: dict) -> dict:
    _SEEN.clear()
    with _swapped(spec["variant"], spec["keep"]):
        run = Run({**spec, "engine": "flatshard"})
        counts = []
        for step in range(STEPS):
            rs = run.step(step)
            ag = [fs.comm_stats(m).calls["all_gather"] for m in run.mine]
            counts.append((ag, rs))
    out = run.compare()
    states = [u.state for m in run.mine for u in get_state(m).units]
    in_place = all(u.replaced_parameter() is None for m in run.mine for u in get_state(m).units)
    return {
        **out,
        "ag": counts[-1][0],
        "ag_first": counts[0][0],
        "groups": [_gathered_groups(m) for m in run.mine],
        "rs": counts[-1][1],
        "reductions": [reductions(m) for m in run.mine],
        "seen": list(_SEEN),
        "released_after": all(s is ParamState.SHARDED for s in states) and in_place,
        "fragments": [p.detach().clone() for m in run.mine for p in m.parameters()],
    }


def case_keep(specs: list[dict]) -> list[dict]:
    """Each spec on every rank: this rank's result, or the error it raised."""
    return run_each(specs, run_keep, _FAILED)


def run_failing(spec: dict) -> dict:
    """The block raises after the schedule's step, on every rank: every unit is released."""
    with _swapped(spec["variant"], spec["keep"]):
        run = Run({**spec, "engine": "flatshard"})
        try:
            with fs.pipeline_step(run.schedule):
                x, y = pipeline_cases.global_batch(0, run.n_mb)
                args = (x.chunk(2)[run.dp_rank],) if 0 in run.ids else ()
                last = run.n_stages - 1 in run.ids
                run.schedule.step(*args, target=y.chunk(2)[run.dp_rank] if last else None)
                raise KeyError("boom")
        except KeyError:
            pass
    units = [u for m in run.mine for u in get_state(m).units]
    return {
        "seen": list(_SEEN),
        "released_after": all(u.state is ParamState.SHARDED for u in units),
        "grads_kept": any(u.has_unreduced_grads() for u in units),
    }


def case_failing(specs: list[dict]) -> list[dict]:
    return run_each(specs, run_failing, _FAILED)


def case_tied_keep(specs: list[dict]) -> list[dict]:
    """``pipeline_tied_cases``' specs (a tied embedding and head), each step kept gathered."""
    import pipeline_tied_cases

    with _swapped("full_shard", True):
        return run_each(specs, pipeline_tied_cases.run_spec, _FAILED)
