"""The rest of the engine's surface: errors, meshes, state dicts, summon, clipping, counts.

Each ``case_*`` runs on every rank of a Gloo pool; the pytest functions only dispatch and check.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import flatshard as fs
from flatshard.api import get_state
from parity_models import Block, LoRAModel, TinyGPT, mesh_for, parity_step, rel_err, state_dict_err
from patching import patched_attr, patched_env


def _tiny_pair(strategy: str = "full_shard", **shard_kwargs) -> tuple[nn.Module, nn.Module]:
    """A seeded TinyGPT reference and its sharded copy (one unit per Block)."""
    torch.manual_seed(0)
    ref = TinyGPT()
    model = fs.shard(
        copy.deepcopy(ref),
        policy=fs.wrap.by_type(Block),
        strategy=strategy,
        mesh=mesh_for(strategy),
        **shard_kwargs,
    )
    return ref, model


def _raises(exc_type, fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except exc_type as err:
        return str(err)
    raise AssertionError(f"{fn.__name__} did not raise {exc_type.__name__}")


def case_bad_input_errors() -> dict[str, str]:
    torch.manual_seed(0)
    out = {
        "no_match": _raises(ValueError, fs.shard, TinyGPT(), policy=fs.wrap.by_type(nn.GRU)),
        "not_module": _raises(TypeError, fs.shard, "model"),
        "bad_strategy": _raises(ValueError, fs.shard, TinyGPT(), strategy="zero4"),
        "container": _raises(
            ValueError, fs.shard, TinyGPT(), policy=lambda m: isinstance(m, nn.ModuleList)
        ),
        "bad_policy_class": _raises(TypeError, fs.wrap.by_type, "Block"),
        "bad_size": _raises(ValueError, fs.wrap.by_size, 0),
    }
    with torch.device("meta"):
        meta_model = LoRAModel()
    out["meta"] = _raises(ValueError, fs.shard, meta_model)
    model = fs.shard(TinyGPT(), policy=fs.wrap.by_type(Block))
    out["twice"] = _raises(ValueError, fs.shard, model)
    out["inner_twice"] = _raises(ValueError, fs.shard, nn.Sequential(model))
    from torch.distributed.device_mesh import init_device_mesh

    mesh_2d = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("r", "s"))
    out["mesh_2d"] = _raises(ValueError, fs.shard, TinyGPT(), mesh=mesh_2d)
    out["bad_mesh"] = _raises(TypeError, fs.shard, TinyGPT(), mesh="world")
    out["hybrid_1d"] = _raises(ValueError, fs.shard, TinyGPT(), strategy="hybrid_shard")
    out["bad_prefetch"] = _raises(TypeError, fs.shard, TinyGPT(), prefetch=2)
    bad_sd = {"emb.weight": torch.zeros(3)} if dist.get_rank() == 0 else {}
    out["bad_state_dict"] = _raises(ValueError, fs.load_full_state_dict, model, bad_sd)
    full = fs.full_state_dict(model)
    if dist.get_rank() == 0:
        full["blocks.1.mlp.fc.weight"] = torch.zeros(37, 25)
    out["bad_shape"] = _raises(ValueError, fs.load_full_state_dict, model, full)
    return out


def test_bad_input_gives_clear_errors(dist_pools):
    for errors in dist_pools(2).run(case_bad_input_errors):
        assert "matched no module" in errors["no_match"] and "GRU" in errors["no_match"]
        assert "nn.Module" in errors["not_module"]
        assert "'zero4'" in errors["bad_strategy"] and "full_shard" in errors["bad_strategy"]
        assert "ModuleList" in errors["container"]
        assert "'Block'" in errors["bad_policy_class"]
        assert "min_params=0" in errors["bad_size"]
        assert "meta device" in errors["meta"] and "lora_a" in errors["meta"]
        assert "already sharded" in errors["twice"] and "already sharded" in errors["inner_twice"]
        assert "2 dimensions" in errors["mesh_2d"]
        assert "DeviceMesh" in errors["bad_mesh"]
        assert "2-D DeviceMesh" in errors["hybrid_1d"] and "replicate" in errors["hybrid_1d"]
        assert "fs.Prefetch" in errors["bad_prefetch"]
        assert "missing" in errors["bad_state_dict"]  # raised on every rank, nothing hangs
        assert "blocks.1.mlp.fc.weight" in errors["bad_shape"] and "(37, 25)" in errors["bad_shape"]


def case_ranks_disagree() -> str:
    torch.manual_seed(0)
    model = TinyGPT(layers=2 + dist.get_rank())
    return _raises(ValueError, fs.shard, model, policy=fs.wrap.by_type(Block))


def test_ranks_that_build_different_models_fail_at_shard_time(dist_pools):
    for message in dist_pools(2).run(case_ranks_disagree):
        assert "ranks disagree" in message and "blocks.2" in message


def case_mesh_parity() -> float:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    ref = TinyGPT()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = fs.shard(copy.deepcopy(ref), policy=fs.wrap.by_type(Block), mesh=mesh)
    group = dist.new_group(list(range(dist.get_world_size())))
    other = fs.shard(copy.deepcopy(ref), policy=fs.wrap.by_type(Block), mesh=group)
    x = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        a, b, r = model(x), other(x), ref(x)
    return max(rel_err(a, r), rel_err(b, r))


@pytest.mark.parametrize("world", [2, 3])
def test_mesh_and_process_group_are_accepted(dist_pools, world):
    assert max(dist_pools(world).run(case_mesh_parity)) <= 1e-6


def case_state_dict_round_trip() -> dict[str, float]:
    torch.manual_seed(0)
    model = fs.shard(TinyGPT(), policy=fs.wrap.by_type(Block))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        x = torch.randint(0, 50, (2, 12))
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    full = fs.full_state_dict(model)
    torch.manual_seed(1)
    other = fs.shard(TinyGPT(), policy=fs.wrap.by_size(900))  # another plan, other init
    fs.load_full_state_dict(other, full)
    again = fs.full_state_dict(other)
    x = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        out_err = rel_err(other(x), model(x))
    if dist.get_rank() != 0:
        return {"empty": float(len(full) + len(again)), "out_err": out_err}
    plain = TinyGPT()
    plain.load_state_dict(full)  # keys and shapes fit a plain model
    tied = plain.head.proj.weight is plain.emb.weight and "head.proj.weight" in full
    sd_err = max(rel_err(again[k], full[k]) for k in full)
    return {"sd_err": sd_err, "out_err": out_err, "tied_key": float(tied), "keys": len(full)}


@pytest.mark.parametrize("world", [2, 3])
def test_full_state_dict_round_trip_across_wrap_plans(dist_pools, world):
    results = dist_pools(world).run(case_state_dict_round_trip)
    assert results[0]["sd_err"] == 0.0 and results[0]["tied_key"] == 1.0
    assert results[0]["keys"] == len(TinyGPT().state_dict())
    assert all(r["out_err"] <= 1e-6 for r in results)
    assert all(r["empty"] == 0.0 for r in results[1:])


def case_summon() -> dict[str, float]:
    torch.manual_seed(0)
    model = fs.shard(TinyGPT(), policy=fs.wrap.by_type(Block))
    with fs.summon_full_params(model):
        shape_ok = model.blocks[0].mlp.fc.weight.shape == (37, 24)
        with torch.no_grad():
            model.blocks[0].mlp.fc.weight.fill_(0.5)
    with fs.summon_full_params(model, writeback=False), torch.no_grad():
        model.lnf.weight.fill_(7.0)
    full = fs.full_state_dict(model)
    x = torch.randint(0, 50, (1, 12))
    model(x).sum().backward()  # still trains after summoning
    frag_ok = all(p.ndim == 1 for p in model.parameters())
    if dist.get_rank() != 0:
        return {"shape_ok": float(shape_ok), "frag_ok": float(frag_ok)}
    return {
        "shape_ok": float(shape_ok),
        "frag_ok": float(frag_ok),
        "written": float((full["blocks.0.mlp.fc.weight"] == 0.5).all()),
        "discarded": float((full["lnf.weight"] != 7.0).all()),
    }


def case_summon_rank0_only() -> dict:
    torch.manual_seed(0)
    model = fs.shard(TinyGPT(), policy=fs.wrap.by_type(Block))
    with fs.summon_full_params(model, rank0_only=True):
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        if dist.get_rank() == 0:
            with torch.no_grad():
                model.blocks[1].qkv.weight.fill_(0.25)
    full = fs.full_state_dict(model)
    out = {"full_shape": float(shapes["blocks.1.qkv.weight"] == (72, 24))}
    if dist.get_rank() == 0:
        out["written"] = float((full["blocks.1.qkv.weight"] == 0.25).all())
    return out


def test_summon_rank0_only_holds_full_params_on_rank0_and_writes_back(dist_pools):
    results = dist_pools(3).run(case_summon_rank0_only)
    assert results[0]["full_shape"] == 1.0 and results[0]["written"] == 1.0
    assert all(r["full_shape"] == 0.0 for r in results[1:])  # the others keep fragments


def case_summon_positional_flags() -> dict:
    """The old positional spelling ``summon_full_params(model, False)`` warns and still works."""
    _, model = _tiny_pair()
    before = fs.full_state_dict(model)
    warned = pytest.warns(DeprecationWarning, match="by name")
    with warned, fs.summon_full_params(model, False), torch.no_grad():  # writeback=False
        model.emb.weight.add_(1.0)
    after = fs.full_state_dict(model)
    return {"unchanged": all(torch.equal(before[k], after[k]) for k in before)}


def test_summon_full_params_positional_flags_are_deprecated(dist_pools):
    assert all(r["unchanged"] for r in dist_pools(2).run(case_summon_positional_flags))


def test_summon_full_params_writes_back_only_when_asked(dist_pools):
    results = dist_pools(3).run(case_summon)
    assert all(r["shape_ok"] == 1.0 and r["frag_ok"] == 1.0 for r in results)
    assert results[0]["written"] == 1.0 and results[0]["discarded"] == 1.0


def case_clip(norm_type: float, strategy: str, form: str = "model") -> tuple[float, float]:
    ref, model = _tiny_pair(strategy)
    world, rank = dist.get_world_size(), dist.get_rank()
    batch = torch.randint(0, 50, (2 * world, 13))
    for net, data in ((model, batch.chunk(world)[rank]), (ref, batch)):
        logits = net(data[:, :-1])
        nn.functional.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten()).backward()
    # torch's signature: the model's parameters (a generator), the for-loop norm; or the model
    target = model if form == "model" else model.parameters()
    total = fs.clip_grad_norm_(target, 0.1, norm_type=norm_type, foreach=form != "params_loop")
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1, norm_type=norm_type)
    # Compare the clipped gradients through one SGD step.
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    sd_err = state_dict_err(model, ref)
    return rel_err(total, ref_total), sd_err


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize(
    "strategy, world", [("full_shard", 3), ("no_shard", 2), ("hybrid_shard", 4)]
)
def test_clip_grad_norm_matches_torch_on_the_reference(dist_pools, norm_type, strategy, world):
    for norm_err, sd_err in dist_pools(world).run(case_clip, norm_type, strategy):
        assert norm_err <= 1e-6 and sd_err <= 1e-6


@pytest.mark.parametrize("form", ["params", "params_loop"])
def test_clip_grad_norm_takes_parameters_like_torch(dist_pools, form):
    for norm_err, sd_err in dist_pools(3).run(case_clip, 2.0, "full_shard", form):
        assert norm_err <= 1e-6 and sd_err <= 1e-6


def case_collective_counts(strategy: str) -> dict:
    torch.manual_seed(0)
    kw = dict(policy=fs.wrap.by_type(Block), strategy=strategy, mesh=mesh_for(strategy))
    per_unit = fs.shard(TinyGPT(layers=3), coalesce=False, split_root=False, **kw)
    torch.manual_seed(0)
    default = fs.shard(TinyGPT(layers=3), **kw)
    lora = fs.shard(LoRAModel(), policy=fs.wrap.by_type(type(LoRAModel().l1)), coalesce=False)
    counts = {}
    tokens = torch.randint(0, 50, (2, 12))
    for name, net, x in (
        ("gpt", per_unit, tokens),
        ("gpt_default", default, tokens),
        ("lora", lora, torch.randn(4, 19)),
    ):
        for _ in range(2):  # the second step runs with recorded prefetch orders
            fs.comm_stats(net, reset=True)
            net(x).sum().backward()
        step = fs.comm_stats(net)
        counts[name] = step.calls
        counts[name + "_rs_bytes"] = step.bytes.get("reduce_scatter", 0)
    trainable = sum(p.numel() for p in LoRAModel().parameters() if p.requires_grad)
    counts["lora_trainable_bytes"] = trainable * 4
    counts["lora_frozen_grads"] = [p.grad is None for p in lora.parameters() if not p.requires_grad]
    return counts


UNITS = 3 + 1  # three blocks and the root
EXPECTED_COUNTS = {  # strategy -> (world, collectives per step of a 3-block TinyGPT)
    # Unit by unit (coalesce=False, split_root=False):
    # full_shard: every unit gathers for forward, the blocks but the last one again for backward
    # (the root and the last unit of the forward stay gathered); one reduce-scatter per unit;
    # one tiny all-reduce of "used" flags.
    "full_shard": (2, {"all_gather": UNITS + 2, "reduce_scatter": UNITS, "usage_all_reduce": 1}),
    "shard_grad_op": (2, {"all_gather": UNITS, "reduce_scatter": UNITS, "usage_all_reduce": 1}),
    "no_shard": (2, {"all_reduce": UNITS, "usage_all_reduce": 1}),
    # hybrid 2x2: reduce-scatter in the shard pair, then all-reduce of the shard across pairs;
    # the usage flags go over both groups.
    "hybrid_shard": (
        4,
        {
            "all_gather": UNITS + 2,
            "reduce_scatter": UNITS,
            "all_reduce": UNITS,
            "usage_all_reduce": 2,
        },
    ),
}


# The defaults: the three blocks are one bucket (engine/buckets.py), the last of the forward,
# kept gathered into the backward; the root is split into its tail (the final norm) and the
# rest (embeddings, tied head; under LAZY_MIN_BYTES, so kept gathered too, see
# test_root_split.py for the lazy root). Forward: root, tail, bucket; backward: nothing to
# regather; one reduce-scatter each for the tail, the bucket and the root.
DEFAULT_COUNTS = {
    "full_shard": {"all_gather": 3, "reduce_scatter": 3, "usage_all_reduce": 1},
    "shard_grad_op": {"all_gather": 3, "reduce_scatter": 3, "usage_all_reduce": 1},
    "no_shard": {"all_reduce": UNITS + 1, "usage_all_reduce": 1},  # no bucket without shards
    "hybrid_shard": {"all_gather": 3, "reduce_scatter": 3, "all_reduce": 3, "usage_all_reduce": 2},
}


@pytest.mark.parametrize("strategy", sorted(EXPECTED_COUNTS))
def test_collectives_per_step(dist_pools, strategy):
    world, expected = EXPECTED_COUNTS[strategy]
    counts = dist_pools(world).run(case_collective_counts, strategy)[0]
    assert counts["gpt"] == expected
    assert counts["gpt_default"] == DEFAULT_COUNTS[strategy]
    # LoRA (full_shard): two units; the frozen groups are gathered, never reduce-scattered.
    assert counts["lora"]["reduce_scatter"] == 2
    # Per unit: at most world-1 fp32 elements of tail padding, and up to 3 elements of 16-byte
    # alignment gap before each of its 2 trainable parameters.
    padding = 2 * ((world - 1) + 2 * 3) * 4
    assert counts["lora_trainable_bytes"] <= counts["lora_rs_bytes"]
    assert counts["lora_rs_bytes"] <= counts["lora_trainable_bytes"] + padding
    assert all(counts["lora_frozen_grads"])


def _lm(net: nn.Module, data: torch.Tensor) -> torch.Tensor:
    logits = net(data[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten())


def case_usage_patterns() -> dict[str, float]:
    """Accumulation over two backward calls, two forwards then one backward, a grad-enabled
    forward that never gets a backward followed by an optimizer step, and no-grad eval."""
    ref, model = _tiny_pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    errs = {}
    for pattern in ("two_backwards", "two_forwards_one_backward", "stale_forward"):
        batches = [torch.randint(0, 50, (2 * world, 13), generator=gen) for _ in range(2)]
        local = [b.chunk(world)[rank] for b in batches]
        if pattern == "two_backwards":
            for b in local:
                (_lm(model, b) / 2).backward()
        elif pattern == "two_forwards_one_backward":
            ((_lm(model, local[0]) + _lm(model, local[1])) / 2).backward()
        else:
            (_lm(model, local[0]) / 2 + _lm(model, local[1]) / 2).backward()
            _lm(model, local[0])  # grad-enabled forward, no backward: root stays gathered
        sum(_lm(ref, b) / 2 for b in batches).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        with torch.no_grad():
            probe = batches[0][:, :-1]
            errs[pattern] = rel_err(model(probe), ref(probe))  # must see the stepped params
    full = fs.full_state_dict(model)
    if rank == 0:
        errs["params"] = max(rel_err(full[k], v) for k, v in ref.state_dict().items())
    return errs


@pytest.mark.parametrize("world", [2, 3])
def test_accumulation_multi_forward_stale_and_eval(dist_pools, world):
    for errs in dist_pools(world).run(case_usage_patterns):
        assert max(errs.values()) <= 1e-5, errs


def case_no_sync(keep: str, strategy: str) -> dict:
    """Two micro-batches per step, the first under no_sync; parity with the global batch."""
    ref, model = _tiny_pair(strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    inside = []
    for _ in range(3):
        batches = [torch.randint(0, 50, (2 * world, 13), generator=gen) for _ in range(2)]
        fs.comm_stats(model, reset=True)
        with fs.no_sync(model, keep=keep):
            (_lm(model, batches[0].chunk(world)[rank]) / 2).backward()
        calls = fs.comm_stats(model).calls
        inside.append(calls.get("reduce_scatter", 0) + calls.get("all_reduce", 0))
        (_lm(model, batches[1].chunk(world)[rank]) / 2).backward()
        sum(_lm(ref, b) / 2 for b in batches).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    err = state_dict_err(model, ref)
    return {"err": err, "reductions_inside": max(inside)}


@pytest.mark.parametrize("keep", ["unsharded", "sharded"])
@pytest.mark.parametrize("strategy, world", [("full_shard", 3), ("hybrid_shard", 4)])
def test_no_sync_accumulation_matches_single_process(dist_pools, keep, strategy, world):
    results = dist_pools(world).run(case_no_sync, keep, strategy)
    assert results[0]["err"] <= 1e-5
    # unsharded: nothing is reduced inside the block; sharded: every micro-batch reduces each
    # of the 4 units (3 blocks + root) once, and hybrid adds the all-reduce across replicas
    # (max over the steps: the first, before the blocks are coalesced, reduces each of the 5
    # units, the root's tail included)
    units = UNITS + 1
    expected = 0 if keep == "unsharded" else units * (2 if strategy == "hybrid_shard" else 1)
    assert all(r["reductions_inside"] == expected for r in results), (expected, results)


def _per_name_init(names: dict[int, str]):
    """An init that depends only on each parameter's name: eager and meta runs must agree."""

    def init(module: nn.Module) -> None:
        prefix = names[id(module)]
        for name, p in module.named_parameters():
            if p.device.type == "meta":
                continue  # another unit's parameter, materialised with that unit
            full = f"{prefix}.{name}" if prefix else name
            seed = sum(ord(c) * (i + 1) for i, c in enumerate(full))
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))

    return init


def case_meta_init() -> dict:
    policy = fs.wrap.by_type(Block)
    with torch.device("meta"):
        meta = TinyGPT()
    meta_names = {id(m): n for n, m in meta.named_modules()}
    fs.shard(meta, policy=policy, init_fn=_per_name_init(meta_names))
    eager = TinyGPT()
    eager_names = {id(m): n for n, m in eager.named_modules()}
    _per_name_init(eager_names)(eager)
    from_meta = fs.full_state_dict(meta)
    with torch.device("meta"):
        default = TinyGPT()
    fs.shard(default, policy=policy)  # reset_parameters() of every leaf
    _lm(default, torch.randint(0, 50, (2, 13))).backward()
    out = {"default_finite": float(all(p.isfinite().all() for p in default.parameters()))}
    with torch.device("meta"):
        lora = LoRAModel()
    out["lora_error"] = _raises(ValueError, fs.shard, lora)  # no reset_parameters for lora_a
    if dist.get_rank() == 0:
        eager_sd = eager.state_dict()
        out["err"] = max(rel_err(from_meta[k], v) for k, v in eager_sd.items())
        out["tied"] = float(from_meta["head.proj.weight"].equal(from_meta["emb.weight"]))
    return out


def test_meta_device_model_is_materialised_unit_by_unit(dist_pools):
    results = dist_pools(3).run(case_meta_init)
    assert results[0]["err"] == 0.0 and results[0]["tied"] == 1.0
    for r in results:
        assert r["default_finite"] == 1.0
        assert "lora_a" in r["lora_error"] and "init_fn" in r["lora_error"]


def case_recompute_runs() -> dict:
    """With checkpointing each block's forward runs twice per step; its activations are not kept."""
    torch.manual_seed(0)
    model = fs.shard(TinyGPT(layers=2), policy=fs.wrap.by_type(Block, nn.Embedding))
    calls = []
    for block in model.blocks:
        original = block.forward
        block.forward = lambda *a, _f=original, **k: calls.append(1) or _f(*a, **k)
    fs.checkpoint_activations(model, fs.wrap.by_type(Block))
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t):
        loss = _lm(model, torch.randint(0, 50, (2, 13)))
    loss.backward()
    return {"calls": len(calls), "saved": len(saved)}


def test_checkpointed_blocks_recompute_in_backward(dist_pools):
    plain = TinyGPT(layers=2)  # the same step without checkpointing saves far more tensors
    saved_plain: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved_plain.append(1) or t, lambda t: t
    ):
        _lm(plain, torch.randint(0, 50, (2, 13)))
    for r in dist_pools(2).run(case_recompute_runs):
        assert r["calls"] == 2 * 2  # two blocks, forward + recomputation
        assert r["saved"] < len(saved_plain) / 2


def test_auto_wrap_picks_the_repeated_block_class():
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from flatshard.wrap import build_plan
    from parity_models import _hf_gpt2, _hf_llama

    for model, block in (
        (TinyGPT(), Block),
        (_hf_gpt2(), GPT2Block),
        (_hf_llama(), LlamaDecoderLayer),
    ):
        policy = fs.wrap.auto()
        plan = build_plan(model, policy)
        assert policy.chosen is block, (type(model).__name__, policy.chosen)
        assert sum(isinstance(m, block) for m in plan.unit_modules) == len(
            [m for m in model.modules() if isinstance(m, block)]
        )
    lone = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
    policy = fs.wrap.auto()
    assert build_plan(lone, policy).unit_modules == [lone] and policy.chosen is None


class WithMethods(TinyGPT):
    def embed_only(self, idx: torch.Tensor) -> torch.Tensor:
        return self.emb.weight[idx] * 2  # reads a root parameter outside forward

    def logits_plus_norm(self, idx: torch.Tensor) -> torch.Tensor:
        return self(idx).mean() + self.emb.weight.pow(2).sum()  # forward nested inside


def case_register_method() -> float:
    torch.manual_seed(0)
    ref = WithMethods()
    model = fs.shard(copy.deepcopy(ref), policy=fs.wrap.by_type(Block))
    fs.register_method(model, "embed_only")
    fs.register_method(model, "logits_plus_norm")
    world, rank = dist.get_world_size(), dist.get_rank()
    x = torch.randint(0, 50, (2 * world, 12))
    for net, idx in ((model, x.chunk(world)[rank]), (ref, x)):
        (net.embed_only(idx).pow(2).mean() + net.logits_plus_norm(idx)).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    full = fs.full_state_dict(model)
    return max(rel_err(full[k], v) for k, v in ref.state_dict().items()) if full else 0.0


def test_registered_methods_run_with_gathered_parameters(dist_pools):
    assert dist_pools(2).run(case_register_method)[0] <= 1e-5


def case_prefetch(forward: int, backward: str) -> dict:
    torch.manual_seed(0)
    ref = TinyGPT(layers=3)
    model = fs.shard(
        copy.deepcopy(ref),
        policy=fs.wrap.by_type(Block),
        prefetch=fs.Prefetch(forward=forward, backward=backward),
        coalesce=False,  # depths in units
        split_root=False,
    )
    gathered: list[int] = []  # units not sharded when block 0 starts (second step on)
    model.blocks[0].register_forward_pre_hook(
        lambda *_: gathered.append(sum(u.gathered for u in fs.units(model)))
    )
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref)]
    world = dist.get_world_size()
    for step in range(3):
        batch = torch.randint(0, 50, (2 * world, 13), generator=torch.Generator().manual_seed(step))
        parity_step(model, ref, opts, batch, _lm)
    err = state_dict_err(model, ref)
    return {"err": err, "gathered_at_block0": gathered[-1]}


@pytest.mark.parametrize(
    "forward, backward, expected",
    [(0, "none", 2), (1, "pre", 3), (2, "post", 4)],  # root + block 0 + `forward` blocks ahead
)
def test_prefetch_depth_and_modes(dist_pools, forward, backward, expected):
    for r in dist_pools(2).run(case_prefetch, forward, backward):
        assert r["err"] <= 1e-5 and r["gathered_at_block0"] == expected


def test_prefetch_config_is_validated():
    with pytest.raises(ValueError, match="forward=-1"):
        fs.Prefetch(forward=-1)
    with pytest.raises(ValueError, match="'sideways'"):
        fs.Prefetch(backward="sideways")


def case_debug_mode_reports_desync() -> str:
    with patched_env(FLATSHARD_DEBUG="1"):
        torch.manual_seed(0)
        model = fs.shard(TinyGPT(), policy=fs.wrap.by_type(Block))
        _lm(model, torch.randint(0, 50, (2, 13))).backward()  # in step: checks pass
        try:
            if dist.get_rank() == 0:
                fs.full_state_dict(model)  # gathers block 0 first...
            else:
                model(torch.randint(0, 50, (2, 12)))  # ...while this gathers the root first
        except RuntimeError as err:
            return str(err)
        return ""


def test_debug_mode_names_mismatched_collectives(dist_pools):
    for message in dist_pools(2).run(case_debug_mode_reports_desync):
        assert "collective mismatch" in message
        assert "unit 0 (Block)" in message and "(TinyGPT)" in message


def case_alignment() -> list[int]:
    """Every full-shape parameter view starts on a 16-byte boundary, odd sizes included."""
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 7), nn.Linear(7, 2))
    offsets: list[int] = []
    for layer in model:
        layer.register_forward_pre_hook(
            lambda m, a: offsets.extend(p.data_ptr() % 16 for p in m.parameters())
        )
    fs.shard(model, policy=fs.wrap.root_only())
    model(torch.randn(2, 3)).sum().backward()
    bf16 = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 7))
    bf16[1].register_forward_pre_hook(
        lambda m, a: offsets.extend(p.data_ptr() % 16 for p in m.parameters())
    )
    fs.shard(bf16, policy=fs.wrap.root_only(), mixed_precision=fs.MixedPrecision(torch.bfloat16))
    bf16(torch.randn(2, 3))
    return offsets


def test_parameters_are_16_byte_aligned_in_the_gathered_buffer(dist_pools):
    offsets = dist_pools(2).run(case_alignment)[0]
    assert len(offsets) == 8 and set(offsets) == {0}


def case_no_sync_from_pieces(keep: str, strategy: str) -> dict:
    """``case_no_sync`` with every eligible gradient reduced from its per-parameter pieces."""
    from flatshard.engine import flat_group

    with patched_attr(flat_group, "PIECES_MIN_BYTES", 0):
        return case_no_sync(keep, strategy)


@pytest.mark.parametrize("keep", ["unsharded", "sharded"])
def test_no_sync_accumulation_from_pieces(dist_pools, keep):
    assert dist_pools(3).run(case_no_sync_from_pieces, keep, "full_shard")[0]["err"] <= 1e-5


def case_reshard_root() -> dict:
    """``reshard_root=True``: the root regathers for its backward (one all-gather more a step),
    is not gathered between forward and backward, and training still matches the reference."""
    out = {}
    for reshard_root in (False, True):
        ref, model = _tiny_pair(reshard_root=reshard_root)
        world, rank = dist.get_world_size(), dist.get_rank()
        gathered_at_loss = []
        for step in range(3):
            batch = torch.randint(
                0, 50, (2 * world, 13), generator=torch.Generator().manual_seed(step)
            )
            fs.comm_stats(model, reset=True)
            loss = _lm(model, batch.chunk(world)[rank])
            root = fs.units(model)[-1]
            assert root.name == "" and root.module is model
            gathered_at_loss.append(root.gathered)
            loss.backward()
            _lm(ref, batch).backward()
            for p in (*model.parameters(), *ref.parameters()):
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-0.5)
                    p.grad = None
        err = state_dict_err(model, ref)
        out[reshard_root] = {"gathers": fs.comm_stats(model).calls["all_gather"], "err": err,
                             "root_at_loss": gathered_at_loss[-1]}  # fmt: skip
    return out


def test_reshard_root_option(dist_pools):
    for r in dist_pools(2).run(case_reshard_root):
        # the root and its tail (split_root) each regather for their backward
        assert r[True]["gathers"] == r[False]["gathers"] + 2, r
        assert r[False]["root_at_loss"] is True and r[True]["root_at_loss"] is False
        assert r[False]["err"] <= 1e-5 and r[True]["err"] <= 1e-5, r


def test_reshard_root_without_effect_warns(dist_pools):
    assert all(dist_pools(2).run(case_reshard_root_warning))


def case_reshard_root_warning() -> bool:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fs.shard(TinyGPT(), policy=fs.wrap.by_type(Block), strategy="no_shard", reshard_root=True)
    return any("reshard_root=True) has no effect" in str(w.message) for w in caught)


def case_divergent_switch(variable: str) -> str:
    """One rank sets a switch the others do not: fs.shard must fail on every rank, naming it."""
    other = {variable: ("0" if variable != "FLATSHARD_DEBUG" else "1")}
    with patched_env(**(other if dist.get_rank() == 1 else {})):
        try:
            fs.shard(TinyGPT(layers=1), policy=fs.wrap.by_type(Block))
        except ValueError as e:
            return str(e)
    return ""


@pytest.mark.parametrize(
    "variable", ["FLATSHARD_GLOO_P2P", "FLATSHARD_GATHER_POOL", "FLATSHARD_DEBUG"]
)
def test_a_rank_with_another_switch_fails_at_shard_naming_it(dist_pools, variable):
    for message in dist_pools(2).run(case_divergent_switch, variable):
        assert "ranks disagree" in message and variable in message, message


def case_switches_read_once() -> dict:
    """The switches are read at fs.shard: changing the environment afterwards changes nothing."""
    model = fs.shard(TinyGPT(layers=1), policy=fs.wrap.by_type(Block))
    with patched_env(FLATSHARD_GLOO_P2P="0"):
        state = get_state(model)  # white-box: the stored switches
        model(torch.randint(0, 50, (2, 5))).sum().backward()
        return {"p2p": state.stats.p2p, "switches": state.switches.describe()}


def test_switches_are_read_once_at_shard(dist_pools):
    r = dist_pools(2).run(case_switches_read_once)[0]
    assert r["p2p"] is True and "switch FLATSHARD_GLOO_P2P=1" in r["switches"]


def case_introspection() -> dict:
    """fs.is_sharded / units / comm_stats / memory_stats on a 2-block TinyGPT."""
    plain = TinyGPT(layers=2)
    model = fs.shard(TinyGPT(layers=2), policy=fs.wrap.by_type(Block))
    units = fs.units(model)
    fs.comm_stats(model, reset=True)
    fs.memory_stats(model, reset_peak=True)
    _lm(model, torch.randint(0, 50, (2, 9))).backward()
    step = fs.comm_stats(model, reset=True)
    after_reset = fs.comm_stats(model)
    memory = fs.memory_stats(model)
    full_bytes = sum(p.numel() * 4 for p in plain.parameters())
    return {
        "sharded": (fs.is_sharded(model), fs.is_sharded(plain)),
        "names": [u.name for u in units],
        "numel": [u.numel for u in units],
        "params": [list(u.params) for u in units],
        "reshard": [u.reshard_after_forward for u in units],
        "parts": [u.part for u in units],
        "gathered_now": [u.gathered for u in fs.units(model)],
        "plain_numel": {n: p.numel() for n, p in plain.named_parameters()},
        "calls": step.calls,
        "after_reset": after_reset.calls,
        "memory": memory,
        "full_bytes": full_bytes,
    }


def test_introspection_api(dist_pools):
    r = dist_pools(2).run(case_introspection)[0]
    assert r["sharded"] == (True, False)
    # The root's tail (the final norm; the head is tied to the embedding) is a unit of its own
    # over the root module; both stay gathered from forward into backward.
    assert r["names"] == ["blocks.0", "blocks.1", "", ""] and r["parts"] == ["", "", "", "tail"]
    assert r["reshard"] == [True, True, False, False]
    every = [n for names in r["params"] for n in names]
    assert sorted(every) == sorted(r["plain_numel"])  # each parameter in exactly one unit
    for names, numel in zip(r["params"], r["numel"], strict=True):
        assert numel == sum(r["plain_numel"][n] for n in names)
    assert r["gathered_now"] == [False] * 4  # after backward everything is released
    # first step (no recorded order yet): 4 gathers for forward, both blocks again for backward
    assert r["calls"] == {"all_gather": 6, "reduce_scatter": 4, "usage_all_reduce": 1}
    assert r["after_reset"] == {}
    m = r["memory"]
    assert r["full_bytes"] / 2 <= m.shard_bytes <= r["full_bytes"] / 2 + 1024  # half + padding
    # between steps only the pool's free buffers remain (kept for the next forward)
    assert 0 < m.gathered_bytes < m.gathered_peak_bytes and m.pool_allocations >= 1
