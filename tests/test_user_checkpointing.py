"""Activation checkpointing by every torch and Hugging Face route, against the unsharded run.

The routes (``checkpoint_routes.ROUTES``) change the sharded copy the way the third-party code
does; the reference keeps its activations. Parity as in DESIGN.md (fp32, 1e-5 relative after
several steps, every rank's gradient fragments checked), at world 2 and 3.
"""

from __future__ import annotations

import functools

import pytest
import torch

import flatshard as fs
from checkpoint_routes import ROUTES
from flatshard.core.state import get_state
from parity_models import TinyGPT, check_parity, train_parity

TORCH_ROUTES = [r for r in ROUTES if not r.startswith("hf_") and r != "none"]
HF_CASES = ["hf_llama", "hf_qwen2", "hf_neox"]


def _sgd(groups):
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9)


def case_routes(names: list[str], routes: list[str], strategy: str, kwargs: dict) -> dict:
    """Every (model, route) pair in one job: {"name/route": train_parity's result}."""
    kwargs = dict(kwargs)
    optimizer = _sgd if kwargs.pop("sgd", False) else None
    out = {}
    for name in names:
        for route in routes:
            out[f"{name}/{route}"] = train_parity(
                name, 3, 2, strategy, route, optimizer=optimizer, **kwargs
            )
    return out


def _run_and_check(pool, names, routes, strategy="full_shard", **kwargs) -> None:
    per_rank = pool.run(case_routes, names, routes, strategy, kwargs)
    for key in per_rank[0]:
        check_parity([r[key] for r in per_rank], f"{key} ({strategy}, world {pool.world})")


@pytest.mark.parametrize("world", [2, 3])
def test_torch_routes_full_shard(dist_pools, world):
    _run_and_check(dist_pools(world), ["gpt_tied", "gpt_nested_units"], TORCH_ROUTES)


@pytest.mark.parametrize("strategy", ["shard_grad_op", "no_shard"])
def test_torch_routes_other_strategies(dist_pools, strategy):
    _run_and_check(dist_pools(2), ["gpt_tied"], TORCH_ROUTES, strategy)


def test_torch_routes_hybrid_shard(dist_pools):
    _run_and_check(dist_pools(4), ["gpt_tied"], TORCH_ROUTES, "hybrid_shard")


@pytest.mark.parametrize("world", [2, 3])
def test_hugging_face_gradient_checkpointing(dist_pools, world):
    """``gradient_checkpointing_enable`` with both ``use_reentrant`` values on real HF models
    (SGD: hf_qwen2 sits at AdamW's noise floor even unsharded, see test_engine_parity)."""
    routes = ["hf_nonreentrant", "hf_reentrant"]
    _run_and_check(dist_pools(world), HF_CASES, routes, sgd=True)


def test_hugging_face_gradient_checkpointing_shard_grad_op(dist_pools):
    _run_and_check(
        dist_pools(2), ["hf_llama"], ["hf_nonreentrant", "hf_reentrant"], "shard_grad_op"
    )


ROUTE_SAMPLE = ["around_reentrant", "inside_reentrant", "composable", "checkpoint_wrapper"]


@pytest.mark.parametrize(
    "extras",
    [
        {"prefetch": fs.Prefetch(forward=2, backward="post")},
        {"prefetch": fs.Prefetch(forward=0, backward="none")},
        {"micro_batches": 2},
        {"offload": fs.CPUOffload(params=True)},
    ],
    ids=["prefetch2_post", "prefetch0_none", "no_sync", "cpu_offload"],
)
def test_routes_with_prefetch_no_sync_and_offload(dist_pools, extras):
    _run_and_check(dist_pools(2), ["gpt_tied", "gpt_nested_units"], ROUTE_SAMPLE, **extras)


def _route_model(route: str, model_name: str = "tiny", layers: int = 4, d: int = 48):
    """(sharded model, loss function, batch maker, the MLP class to count) for a route."""
    from parity_models import CASES, MLP, Block, _lm_loss, _tokens

    torch.manual_seed(0)
    if model_name == "tiny":
        model, policy, loss, mlp = (
            TinyGPT(layers=layers, d=d),
            fs.wrap.by_type(Block),
            _lm_loss,
            MLP,
        )
    else:
        case = CASES[model_name]
        model, policy, loss = case.build(), case.policy(), case.loss
        mlp = type(model.model.layers[0].mlp)
    ROUTES[route].before_shard(model)
    fs.shard(model, policy=ROUTES[route].policy(policy), coalesce=False)  # per-unit counts
    ROUTES[route].after_shard(model, policy)
    return model, loss, _tokens, mlp


def _gathered_ptrs(state) -> set[int]:
    return {b.untyped_storage().data_ptr() for b in state.gathered_buffers()}


def case_step_costs(routes: list[str], model_name: str = "tiny", size: tuple = (4, 48)) -> dict:
    """Per route, on the second step: collectives, MLP forward runs, and live tensor bytes
    (gathered buffers excluded) at the end of forward and at the peak of the step, and the
    peak of gathered bytes."""
    from flatshard.tools.estimate.measure import LiveBytes

    out = {}
    for route in routes:
        model, loss_fn, tokens, mlp = _route_model(route, model_name, *size)
        state = get_state(model)  # white-box: the gathered buffers to leave out of the count
        runs: list[int] = []
        for m in model.modules():
            if isinstance(m, mlp):
                m.register_forward_pre_hook(lambda *_, runs=runs: runs.append(1))
        batch = tokens(torch.Generator().manual_seed(0), 4)
        for _ in range(2):  # the second step runs with the recorded prefetch orders
            fs.comm_stats(model, reset=True)
            fs.memory_stats(model, reset_peak=True)
            runs.clear()
            with LiveBytes(functools.partial(_gathered_ptrs, state), lambda: 0) as live:
                loss = loss_fn(model, batch)
                after_forward = live.current
                loss.backward()
            model.zero_grad()
        out[route] = {
            "calls": fs.comm_stats(model).calls,
            "mlp_runs": len(runs),
            "activations": after_forward,
            "peak": live.peak,
            "gathered_peak": fs.memory_stats(model).gathered_peak_bytes,
        }
    return out


# Routes that checkpoint each whole block, as fs.checkpoint_activations does (the "_parts" and
# "_mlp" ones checkpoint less, on purpose: they exercise a unit with several regions).
WHOLE_BLOCK_ROUTES = [r for r in TORCH_ROUTES if not r.endswith(("_parts", "_mlp"))]


def test_recomputation_regathers_nothing_and_saves_what_fs_checkpointing_saves(dist_pools):
    routes = ["none", *TORCH_ROUTES]
    r = dist_pools(2).run(case_step_costs, routes)[0]
    plain, ours = r["none"], r["fs_checkpoint_activations"]
    assert plain["mlp_runs"] == 4 and ours["mlp_runs"] == 8  # 4 blocks: forward (+ recompute)
    assert ours["activations"] < plain["activations"] / 4
    for route in TORCH_ROUTES:
        got = r[route]
        # With the root's tail split off (the default) the last unit of the forward is
        # released after forward and regathered in every route, so no route costs a gather
        # more (a reentrant checkpoint used to: it runs the first forward under no_grad).
        assert got["calls"] == plain["calls"], (route, got["calls"])
        assert got["mlp_runs"] == 8, f"{route} did not recompute: {got['mlp_runs']}"
        if route in WHOLE_BLOCK_ROUTES:
            assert got["activations"] <= ours["activations"] * 1.05, (route, got, ours)
            assert got["peak"] <= ours["peak"] * 1.10, (route, got, ours)
        # No route keeps more units gathered (a reentrant checkpoint inside a unit's forward
        # reduces the unit when its input's gradient is complete, before the unit below
        # gathers: see _post_backward_on_inputs).
        assert got["gathered_peak"] <= ours["gathered_peak"], (route, got, ours)


def case_double_checkpointing() -> dict:
    """fs.checkpoint_activations on blocks another route already checkpoints: refused."""
    from parity_models import CASES, Block

    errors = {}
    for route in ["composable", "checkpoint_wrapper_unit", "hf_nonreentrant"]:
        name = "hf_llama" if route.startswith("hf_") else "tiny"
        model = _route_model(route, name)[0]
        base = CASES[name].policy() if name != "tiny" else fs.wrap.by_type(Block)
        policy = ROUTES[route].policy(base)
        try:
            fs.checkpoint_activations(model, policy)
            errors[route] = ""
        except ValueError as e:
            errors[route] = str(e)
    return errors


def test_checkpointing_a_module_twice_is_refused(dist_pools):
    errors = dist_pools(2).run(case_double_checkpointing)[0]
    assert "torch.distributed._composable.checkpoint" in errors["composable"]
    assert "CheckpointWrapper" in errors["checkpoint_wrapper_unit"]
    assert "gradient_checkpointing_enable" in errors["hf_nonreentrant"]
    assert all("Use one route" in e for e in errors.values()), errors


def _train_mp(route: str) -> dict:
    from parity_models import Block, _lm_loss, _tokens

    torch.manual_seed(0)
    model = TinyGPT(layers=3)
    ROUTES[route].before_shard(model)
    mp = fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    policy = fs.wrap.by_type(Block)
    fs.shard(model, policy=ROUTES[route].policy(policy), mixed_precision=mp)
    ROUTES[route].after_shard(model, policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for step in range(3):
        batch = _tokens(torch.Generator().manual_seed(step), 2 * world).chunk(world)[rank]
        _lm_loss(model, batch).float().backward()
        opt.step()
        opt.zero_grad()
    return fs.full_state_dict(model)


def case_mixed_precision_routes(routes: list[str]) -> dict[str, float]:
    """bf16 compute, fp32 reduce: each route against the same sharded run without one (the
    fp32 unsharded run is no reference for bf16): the largest relative difference."""
    from parity_models import rel_err

    plain = _train_mp("none")
    out = {}
    for route in routes:
        full = _train_mp(route)
        out[route] = max((rel_err(full[k], v) for k, v in plain.items()), default=0.0)
    return out


def test_routes_under_mixed_precision_change_nothing(dist_pools):
    errors = dist_pools(2).run(case_mixed_precision_routes, ROUTE_SAMPLE)[0]
    assert errors.keys() == set(ROUTE_SAMPLE)
    assert all(e <= 1e-6 for e in errors.values()), errors
