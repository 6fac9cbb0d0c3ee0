"""The rest of the engine's surface: errors, meshes, state dicts, summon, clipping, meta init,
switches and introspection (step mechanics: test_engine_step.py).

Each ``case_*`` runs on every rank of a Gloo pool; the pytest functions only dispatch and check.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import flatshard as fs
from flatshard.core.state import get_state
from parity_models import Block, LoRAModel, TinyGPT, _lm_loss, rel_err, state_dict_err
from patching import patched_env
from tiny_pair import tiny_pair


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
    _, model = tiny_pair()
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
    ref, model = tiny_pair(strategy)
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
    _lm_loss(default, torch.randint(0, 50, (2, 13))).backward()
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


class _BufferRoot(nn.Module):
    """A middle pipeline stage's shape: every parameter in wrapped blocks, a buffer (a rotary
    table) at the root."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.register_buffer("table", torch.empty(4))

    def reset_parameters(self) -> None:
        self.table.copy_(torch.arange(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](self.blocks[0](x)) * self.table


def case_meta_root_of_buffers_only() -> list[float]:
    with torch.device("meta"):
        model = _BufferRoot()
    fs.shard(model, policy=fs.wrap.by_type(nn.Linear))  # the root unit holds no parameter
    return model.table.tolist()


def test_a_meta_root_holding_only_buffers_is_materialised(dist_pools):
    """The root unit has no parameters of its own, so no unit materialises its buffers unless
    fs.shard does it for the root itself."""
    for table in dist_pools(2).run(case_meta_root_of_buffers_only):
        assert table == [0.0, 1.0, 2.0, 3.0]


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


def case_debug_mode_reports_desync() -> str:
    with patched_env(FLATSHARD_DEBUG="1"):
        torch.manual_seed(0)
        model = fs.shard(TinyGPT(), policy=fs.wrap.by_type(Block))
        _lm_loss(model, torch.randint(0, 50, (2, 13))).backward()  # in step: checks pass
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
        state = get_state(model)  # white-box: the switches fs.shard read (not reported)
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
    _lm_loss(model, torch.randint(0, 50, (2, 9))).backward()
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
        "unit_bytes": [u.full_bytes for u in units],
        "lazy": [u.lazy for u in units],
        "bucket": [u.bucket for u in fs.units(model)],
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
    assert r["lazy"] == [False] * 4  # the root is below LAZY_MIN_BYTES: it stays gathered
    assert r["bucket"] == [0, 0, None, None]  # the tiny blocks are coalesced, the root never
    every = [n for names in r["params"] for n in names]
    assert sorted(every) == sorted(r["plain_numel"])  # each parameter in exactly one unit
    for names, numel, full in zip(r["params"], r["numel"], r["unit_bytes"], strict=True):
        assert numel == sum(r["plain_numel"][n] for n in names)
        assert 4 * numel <= full <= 4 * numel + 1024  # fp32, padding included
    assert r["gathered_now"] == [False] * 4  # after backward everything is released
    # first step: the two blocks' bucket (planned at fs.shard), the root and its tail in
    # forward, the bucket again for backward (no recorded order yet to keep it gathered);
    # reductions: the bucket, the root, the tail
    assert r["calls"] == {"all_gather": 4, "reduce_scatter": 3, "usage_all_reduce": 1}
    assert r["after_reset"] == {}
    m = r["memory"]
    assert r["full_bytes"] / 2 <= m.shard_bytes <= r["full_bytes"] / 2 + 1024  # half + padding
    assert sum(r["unit_bytes"]) == 2 * m.shard_bytes  # each unit's full buffer: two shards
    # between steps nothing stays gathered: the bucket (one unit), the root and its tail all
    # use private buffers, so this model has no gather pool; the bucket allocated its buffer
    # at each of its two gathers
    assert 0 == m.gathered_bytes < m.gathered_peak_bytes and m.pool_allocations == 0
    assert m.bucket_storage_allocations == 2 and m.cached_bytes == 0


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_rank_chunk_starts_on_16_bytes(world, dtype):
    """An odd total in bf16 at world 3 used to start rank 1's chunk 6 bytes off 16."""
    from flatshard.core.layout import FlatLayout, align_elements

    align = align_elements(dtype)
    for shapes in ([(3, 5)], [(7,), (1,), (13, 3)], [(1,)]):
        layout = FlatLayout([torch.Size(s) for s in shapes], world=world, rank=0, align=align)
        chunk_bytes = layout.shard_numel * dtype.itemsize
        assert chunk_bytes % 16 == 0, (shapes, world, dtype, layout.shard_numel)


def test_the_current_cuda_device_must_be_the_processs_own():
    """torchrun starts every process on cuda:0: fs.shard names the fix (checked without a GPU:
    the check is a function of the current device, LOCAL_RANK and the device count)."""
    from flatshard.core.mesh import check_cuda_device

    check_cuda_device(3, "3", 8)  # set_device(LOCAL_RANK) was called
    check_cuda_device(1, "9", 8)  # a second node's numbering wraps
    check_cuda_device(0, None, 8)  # not launched by torchrun: nothing to compare with
    check_cuda_device(0, "3", 1)  # one GPU per process (CUDA_VISIBLE_DEVICES)
    with pytest.raises(ValueError, match=r"cuda:0.*LOCAL_RANK=3.*torch.cuda.set_device"):
        check_cuda_device(0, "3", 8)
