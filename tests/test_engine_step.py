"""The engine's step mechanics: collectives per step, usage patterns, no_sync, prefetch,
recomputation, registered methods and the reshard_root option.

Each ``case_*`` runs on every rank of a Gloo pool; the pytest functions only dispatch and check.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import flatshard as fs
from parity_models import (
    Block,
    LoRAModel,
    TinyGPT,
    _lm_loss,
    mesh_for,
    parity_step,
    rel_err,
    state_dict_err,
)
from patching import patched_attr
from tiny_pair import tiny_pair


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


# The defaults: the three blocks are one bucket (features/buckets.py), the last of the forward;
# the root is split into its tail (the final norm) and the rest (embeddings, tied head; under
# LAZY_MIN_BYTES, so kept gathered, see test_root_split.py for the lazy root). Forward: root,
# tail, bucket; the tail's backward comes first, so the bucket is released before the loss
# like a plain last unit (see [Note: one post-forward] in core/hooks.py) and regathered in
# backward (full_shard); one reduce-scatter each for the tail, the bucket and the root.
DEFAULT_COUNTS = {
    "full_shard": {"all_gather": 4, "reduce_scatter": 3, "usage_all_reduce": 1},
    "shard_grad_op": {"all_gather": 3, "reduce_scatter": 3, "usage_all_reduce": 1},
    "no_shard": {"all_reduce": UNITS + 1, "usage_all_reduce": 1},  # no bucket without shards
    "hybrid_shard": {"all_gather": 4, "reduce_scatter": 3, "all_reduce": 3, "usage_all_reduce": 2},
}


@pytest.mark.parametrize("strategy", sorted(EXPECTED_COUNTS))
def test_collectives_per_step(dist_pools, strategy):
    world, expected = EXPECTED_COUNTS[strategy]
    counts = dist_pools(world).run(case_collective_counts, strategy)[0]
    assert counts["gpt"] == expected
    assert counts["gpt_default"] == DEFAULT_COUNTS[strategy]
    # LoRA (full_shard): two units; the frozen groups are gathered, never reduce-scattered.
    assert counts["lora"]["reduce_scatter"] == 2
    # Per unit: tail padding to whole 16-byte chunks (at most world*4-1 fp32 elements), and
    # up to 3 elements of 16-byte alignment gap before each of its 2 trainable parameters.
    padding = 2 * ((world * 4 - 1) + 2 * 3) * 4
    assert counts["lora_trainable_bytes"] <= counts["lora_rs_bytes"]
    assert counts["lora_rs_bytes"] <= counts["lora_trainable_bytes"] + padding
    assert all(counts["lora_frozen_grads"])


def case_usage_patterns() -> dict[str, float]:
    """Accumulation over two backward calls, two forwards then one backward, a grad-enabled
    forward that never gets a backward followed by an optimizer step, and no-grad eval."""
    ref, model = tiny_pair()
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
                (_lm_loss(model, b) / 2).backward()
        elif pattern == "two_forwards_one_backward":
            ((_lm_loss(model, local[0]) + _lm_loss(model, local[1])) / 2).backward()
        else:
            (_lm_loss(model, local[0]) / 2 + _lm_loss(model, local[1]) / 2).backward()
            _lm_loss(model, local[0])  # grad-enabled forward, no backward: root stays gathered
        sum(_lm_loss(ref, b) / 2 for b in batches).backward()
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
    ref, model = tiny_pair(strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    inside = []
    for _ in range(3):
        batches = [torch.randint(0, 50, (2 * world, 13), generator=gen) for _ in range(2)]
        fs.comm_stats(model, reset=True)
        with fs.no_sync(model, keep=keep):
            (_lm_loss(model, batches[0].chunk(world)[rank]) / 2).backward()
        calls = fs.comm_stats(model).calls
        inside.append(calls.get("reduce_scatter", 0) + calls.get("all_reduce", 0))
        (_lm_loss(model, batches[1].chunk(world)[rank]) / 2).backward()
        sum(_lm_loss(ref, b) / 2 for b in batches).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    err = state_dict_err(model, ref)
    return {"err": err, "reductions_inside": max(inside)}


@pytest.mark.parametrize("keep", ["unsharded", "sharded"])
@pytest.mark.parametrize("strategy, world", [("full_shard", 3), ("hybrid_shard", 4)])
def test_no_sync_accumulation_matches_single_process(dist_pools, keep, strategy, world):
    results = dist_pools(world).run(case_no_sync, keep, strategy)
    assert results[0]["err"] <= 1e-5
    # unsharded: nothing is reduced inside the block; sharded: every micro-batch reduces the
    # bucket of the 3 blocks (coalesced from the first step: planned at fs.shard), the root and
    # the root's tail once each, and hybrid adds the all-reduce across replicas
    reductions = 3
    expected = 0 if keep == "unsharded" else reductions * (2 if strategy == "hybrid_shard" else 1)
    assert all(r["reductions_inside"] == expected for r in results), (expected, results)


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
        loss = _lm_loss(model, torch.randint(0, 50, (2, 13)))
    loss.backward()
    return {"calls": len(calls), "saved": len(saved)}


def test_checkpointed_blocks_recompute_in_backward(dist_pools):
    plain = TinyGPT(layers=2)  # the same step without checkpointing saves far more tensors
    saved_plain: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved_plain.append(1) or t, lambda t: t
    ):
        _lm_loss(plain, torch.randint(0, 50, (2, 13)))
    for r in dist_pools(2).run(case_recompute_runs):
        assert r["calls"] == 2 * 2  # two blocks, forward + recomputation
        assert r["saved"] < len(saved_plain) / 2


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
        parity_step(model, ref, opts, batch, _lm_loss)
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


def case_no_sync_from_pieces(keep: str, strategy: str) -> dict:
    """``case_no_sync`` with every eligible gradient reduced from its per-parameter pieces."""
    from flatshard.core import reduce

    with patched_attr(reduce, "PIECES_MIN_BYTES", 0):
        return case_no_sync(keep, strategy)


@pytest.mark.parametrize("keep", ["unsharded", "sharded"])
def test_no_sync_accumulation_from_pieces(dist_pools, keep):
    assert dist_pools(3).run(case_no_sync_from_pieces, keep, "full_shard")[0]["err"] <= 1e-5


def case_reshard_root() -> dict:
    """``reshard_root=True``: the root regathers for its backward (one all-gather more a step),
    is not gathered between forward and backward, and training still matches the reference."""
    out = {}
    for reshard_root in (False, True):
        ref, model = tiny_pair(reshard_root=reshard_root)
        world, rank = dist.get_world_size(), dist.get_rank()
        gathered_at_loss = []
        for step in range(3):
            batch = torch.randint(
                0, 50, (2 * world, 13), generator=torch.Generator().manual_seed(step)
            )
            fs.comm_stats(model, reset=True)
            loss = _lm_loss(model, batch.chunk(world)[rank])
            root = fs.units(model)[-1]
            assert root.name == "" and root.module is model
            gathered_at_loss.append(root.gathered)
            loss.backward()
            _lm_loss(ref, batch).backward()
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
