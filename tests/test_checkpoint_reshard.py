"""Save at world 2 after 3 AdamW steps, load at world 3 / world 1 under other wrap plans, train
2 more steps: the result must equal one uninterrupted single-process run on the same global
batches (fp32, 1e-5 relative, noise-floor elements excluded as in the engine's parity tests).

Each ``case_*`` runs on every rank of a Gloo pool; the pytest functions dispatch and check.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

import flatshard as fs
import flatshard.checkpoint as ckpt
from parity_models import (
    CASES,
    MLP,
    Block,
    TinyGPT,
    named_param_groups,
    rel_err,
)

GLOBAL_ROWS, SAVE_AT, TOTAL = 6, 3, 5  # 6 rows split evenly over 1, 2 and 3 ranks
LR = 1e-3
POLICIES = {
    "by_type_block": lambda: fs.wrap.by_type(Block),
    "by_size": lambda: fs.wrap.by_size(1500),
    "block_and_mlp": lambda: fs.wrap.by_type(Block, MLP),
}
_loss = CASES["gpt_tied"].loss
NOISE_FLOOR = 1e-5  # as in parity_models: AdamW turns gradients this small into noise


def _mark_noise_floor(ref: nn.Module, noisy: dict) -> None:
    """Elements whose gradient is nonzero but at the rounding-noise level of its tensor."""
    for p in ref.parameters():
        if p.grad is not None and p.grad.numel():
            magnitude = p.grad.abs()
            noisy[id(p)] |= (magnitude > 0) & (magnitude <= NOISE_FLOOR * magnitude.max())


def _batch(step: int) -> torch.Tensor:
    return CASES["gpt_tied"].batch(torch.Generator().manual_seed(step), GLOBAL_ROWS)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, sharded: bool) -> list:
    world, rank = (dist.get_world_size(), dist.get_rank()) if sharded else (1, 0)
    losses = []
    for step in steps:
        loss = _loss(model, _batch(step).chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        if sharded:
            dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def case_save(path: str) -> None:
    torch.manual_seed(0)
    model = fs.shard(TinyGPT(), policy=POLICIES["by_type_block"]())
    opt = torch.optim.AdamW(named_param_groups(model), lr=LR)
    _train(model, opt, range(SAVE_AT), sharded=True)
    torch.manual_seed(123)
    random.seed(5)
    extra = {"step": SAVE_AT, "rng": torch.get_rng_state(), "py_rng": random.getstate()}
    extra["data"] = {"epoch": 0, "position": [SAVE_AT * GLOBAL_ROWS], "lr": 0.5}
    ckpt.save(path, model=model, optimizer=opt, extra=extra)


def _state_err(opt: torch.optim.Optimizer, ref_opt: torch.optim.Optimizer, model, ref) -> float:
    """Largest relative difference of this rank's optimizer-state fragments to the reference."""
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, info in fs.fragment_info(model).items():
        start, end = info.flat_range
        want = ref_opt.state[ref_params[name]]
        have = opt.state[info.fragment]
        assert set(have) == set(want), (name, set(have), set(want))
        worst = max(worst, rel_err(have["step"], want["step"]))
        for key in ("exp_avg", "exp_avg_sq"):
            full = want[key].reshape(-1)
            scale = max(full.abs().max().item(), 1e-12)
            err = (have[key] - full[start:end]).abs().max().item() if end > start else 0
            worst = max(worst, err / scale)
    return worst


def case_resume(path: str, policy: str) -> dict:
    torch.manual_seed(0)
    ref = TinyGPT()
    ref_opt = torch.optim.AdamW(named_param_groups(ref), lr=LR)
    noisy = {id(p): torch.zeros_like(p, dtype=torch.bool) for p in ref.parameters()}
    torch.manual_seed(7)  # another init: everything must come from the checkpoint
    model = fs.shard(TinyGPT(), policy=POLICIES[policy]())
    opt = torch.optim.AdamW(named_param_groups(model), lr=LR * 10)
    extra = ckpt.load(path, model=model, optimizer=opt)
    ref_losses = []
    for step in range(TOTAL):
        if step == SAVE_AT:
            state_err = _state_err(opt, ref_opt, model, ref)
        loss = _loss(ref, _batch(step))
        loss.backward()
        _mark_noise_floor(ref, noisy)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    lrs = [g["lr"] for g in opt.param_groups]
    losses = _train(model, opt, range(SAVE_AT, TOTAL), sharded=True)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses[SAVE_AT:], strict=True))
    full = fs.full_state_dict(model)
    out = {"state_err": state_err, "loss_err": loss_err, "lrs": lrs, "extra": extra}
    if dist.get_rank() == 0:
        sd_err, masked = 0.0, 0
        for key, value in ref.state_dict(keep_vars=True).items():
            keep = ~noisy[id(value)] if id(value) in noisy else torch.ones_like(value, dtype=bool)
            masked += int((~keep).sum())
            sd_err = max(sd_err, rel_err(full[key][keep], value.detach()[keep]))
        total = sum(p.numel() for p in ref.parameters())
        out.update(sd_err=sd_err, noisy_fraction=masked / total, keys=list(full))
    return out


@pytest.fixture(scope="module")
def saved_at_world_2(dist_pools, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("reshard") / "step3")
    dist_pools(2).run(case_save, path)
    return path


@pytest.mark.parametrize(
    ("world", "policy"), [(3, "by_size"), (1, "block_and_mlp"), (2, "by_size")]
)
def test_resume_at_another_world_size_and_plan_matches_one_process(
    dist_pools, saved_at_world_2, world, policy
):
    results = dist_pools(world).run(case_resume, saved_at_world_2, policy)
    for r in results:
        assert r["state_err"] <= 1e-5  # AdamW exp_avg / exp_avg_sq / step resharded by name
        assert r["loss_err"] <= 1e-5
        assert r["lrs"] == [LR, LR]  # hyperparameters come from the checkpoint
        extra = r["extra"]
        torch.manual_seed(123)
        assert torch.equal(extra["rng"], torch.get_rng_state())
        random.seed(5)
        assert extra["py_rng"] == random.getstate()  # tuples come back as tuples
        assert extra["step"] == SAVE_AT and extra["data"]["position"] == [SAVE_AT * GLOBAL_ROWS]
    rank0 = results[0]
    assert rank0["keys"] == list(TinyGPT().state_dict())
    assert rank0["noisy_fraction"] < 0.01 and rank0["sd_err"] <= 1e-5


def test_saved_description_names_parameters_and_state(saved_at_world_2):
    opened = ckpt.loader.open_checkpoint(saved_at_world_2)
    keys = set(opened.metadata.state_dict_metadata)
    sd = TinyGPT().state_dict()
    assert "emb.weight" in keys and "head.proj.weight" in keys  # tied: under both, as torch
    assert opened.description["model"]["aliases"] == {"head.proj.weight": "emb.weight"}
    # the standard DCP layout: every parameter (and its AdamW moments) with its full shape
    for name in ("blocks.0.qkv.weight", "optimizer.state.blocks.0.qkv.weight.exp_avg"):
        assert opened.metadata.state_dict_metadata[name].size == sd["blocks.0.qkv.weight"].shape
    for name in (
        "optimizer.state.emb.weight.exp_avg",  # torch's get_optimizer_state_dict keys
        "optimizer.state.emb.weight.exp_avg_sq",
        "optimizer.state.emb.weight.step",
        "optimizer.param_groups.0.lr",  # pickled for torch's tools, never read by flatshard
        "optimizer.param_groups.0.params",
    ):
        assert name in keys
    chunks = opened.metadata.state_dict_metadata["blocks.1.mlp.fc.weight"].chunks
    assert sum(c.sizes.numel() for c in chunks) == sd["blocks.1.mlp.fc.weight"].numel()
    assert 1 <= len(chunks) <= 2 * 3  # at most two fragments of 3 rectangles each (a matrix)
    assert opened.description["world_size"] == 2
    assert opened.description["optimizer"]["class"] == "AdamW"


def case_replicated(path: str, save: bool) -> dict:
    """Save a replicated (no_shard) model: every rank offers identical full chunks and DCP
    keeps one; load it fully sharded. Returns per parameter name the exp_avg pieces held."""
    torch.manual_seed(0 if save else 2)
    model = fs.shard(TinyGPT(), strategy="no_shard" if save else "full_shard")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    if save:
        _train(model, opt, range(1), sharded=True)
        ckpt.save(path, model=model, optimizer=opt)
    else:
        ckpt.load(path, model=model, optimizer=opt)
    pieces = {}
    for name, info in fs.fragment_info(model).items():
        pieces[name] = (info.flat_range, opt.state[info.fragment]["exp_avg"])
    return {"pieces": pieces, "full": fs.full_state_dict(model)}


def test_replicated_save_loads_sharded(dist_pools, tmp_path):
    saved = dist_pools(2).run(case_replicated, str(tmp_path / "c"), True)
    loaded = dist_pools(3).run(case_replicated, str(tmp_path / "c"), False)
    assert all(torch.equal(loaded[0]["full"][k], v) for k, v in saved[0]["full"].items())
    for result in loaded:
        for name, ((start, end), exp_avg) in result["pieces"].items():
            (_, _), full = saved[0]["pieces"][name]  # no_shard: the fragment is the parameter
            assert torch.equal(exp_avg, full[start:end]), name
