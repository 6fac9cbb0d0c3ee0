"""The root's tail and the lazy root (features/root_split.py, features/lazy_root.py).

The parity models' roots are below ``LAZY_MIN_BYTES``, so the default keeps them gathered;
here the threshold is patched to 0 so that every route through the lazy root runs: a tied head
(its saved weight regathers the root on demand), an untied one (never regathered), activation
checkpointing of units and of root-level modules (placeholders), registered methods.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import flatshard as fs
from flatshard.core.state import get_state
from flatshard.features import root_split
from parity_models import (
    Block,
    TinyGPT,
    _lm_loss,
    _tokens,
    check_parity,
    rel_err,
    state_dict_err,
    train_parity,
)
from patching import patched_attr


def lazy_parity(name: str, strategy: str = "full_shard", route: str | bool = False) -> list:
    with patched_attr(root_split, "LAZY_MIN_BYTES", 0):
        return train_parity(name, 5, 2, strategy, route)


@pytest.mark.parametrize(
    "name, strategy, route, world",
    [
        ("gpt_tied", "full_shard", False, 3),
        ("gpt_tied", "hybrid_shard", False, 4),
        ("gpt_nested_units", "full_shard", True, 2),
        ("gpt_tied", "full_shard", "around_reentrant", 2),
        ("gpt_tied", "full_shard", "inside_reentrant_parts", 3),
        ("hf_llama", "full_shard", False, 3),
        ("hf_gpt2", "full_shard", False, 2),
    ],
)
def test_lazy_root_matches_single_process(dist_pools, name, strategy, route, world):
    check_parity(dist_pools(world).run(lazy_parity, name, strategy, route), f"{name} {route}")


class RootCheckpointed(TinyGPT):
    """Root-level modules under torch's checkpoint: their recomputation in backward reads the
    root's parameters, which the lazy root holds as placeholders then."""

    reentrant = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = checkpoint(self.emb, idx, use_reentrant=self.reentrant) + self.pos(
            torch.arange(idx.shape[1])
        )
        if self.reentrant:  # a reentrant checkpoint needs an input that requires grad
            x = x + 0 * x.detach().requires_grad_()
        for block in self.blocks:
            x = block(x)
        return checkpoint(lambda h: self.head(self.lnf(h)), x, use_reentrant=self.reentrant)


def case_root_level_checkpoint(reentrant: bool) -> dict:
    torch.manual_seed(0)
    ref = RootCheckpointed(layers=3)
    ref.reentrant = reentrant
    with patched_attr(root_split, "LAZY_MIN_BYTES", 0):
        model = fs.shard(copy.deepcopy(ref), policy=fs.wrap.by_type(Block))
    lazy = [(u.name, u.part) for u in fs.units(model) if u.lazy]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    world, rank = dist.get_world_size(), dist.get_rank()
    loss_err = 0.0
    for step in range(4):
        batch = _tokens(torch.Generator().manual_seed(step), 2 * world)
        loss = _lm_loss(model, batch.chunk(world)[rank])
        loss.backward()
        ref_loss = _lm_loss(ref, batch)
        ref_loss.backward()
        for opt in opts:
            opt.step(), opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        loss_err = max(loss_err, rel_err(mean / world, ref_loss.detach()))
    return {"lazy": lazy, "loss_err": loss_err, "sd_err": state_dict_err(model, ref)}


@pytest.mark.parametrize("reentrant", [False, True])
def test_root_level_checkpointing_reads_placeholders(dist_pools, reentrant):
    for r in dist_pools(2).run(case_root_level_checkpoint, reentrant):
        assert r["lazy"] == [("", "")], r  # the root, not its tail
        assert r["loss_err"] <= 1e-5 and r["sd_err"] <= 1e-5, r


def case_lazy_root_gathers() -> dict:
    """An untied Llama: the root (embeddings) is released after forward and never regathered
    in backward; the tail (final norm, head) is gathered through the loss."""
    from parity_models import CASES

    case = CASES["hf_llama"]
    torch.manual_seed(0)
    with patched_attr(root_split, "LAZY_MIN_BYTES", 0):
        model = fs.shard(case.build(), policy=case.policy())
    info = fs.units(model)
    lazy = next(u.index for u in info if u.lazy)
    tail_index = next(u.index for u in info if u.part == "tail")
    # white-box: a spy on the lazy root's gathers, and both units' exact states at the loss
    root, tail = (get_state(model).units[i] for i in (lazy, tail_index))
    gathers = []
    original = root.start_gather

    def counting():
        if root.state.value == "sharded":  # a call while gathering is a no-op
            gathers.append(1)
        original()

    root.start_gather = counting
    at_loss = []
    for step in range(3):
        batch = _tokens(torch.Generator().manual_seed(step), 2)
        gathers.clear()
        loss = case.loss(model, batch)
        at_loss.append((root.state.value, tail.state.value))
        loss.backward()
    names = [p.split(".")[-2] for p in next(u for u in info if u.part == "tail").params]
    return {"gathers_last_step": len(gathers), "at_loss": at_loss[-1], "tail_modules": names}


def test_untied_root_is_never_regathered_in_backward(dist_pools):
    for r in dist_pools(2).run(case_lazy_root_gathers):
        assert r["gathers_last_step"] == 1, r  # forward only
        assert r["at_loss"] == ("sharded", "unsharded"), r
        assert r["tail_modules"] == ["norm", "lm_head"], r


def test_split_root_off_keeps_one_root(dist_pools):
    results = dist_pools(2).run(_parts)
    for parts_on, parts_off in results:
        assert parts_on.count("tail") == 1 and "tail" not in parts_off


def _parts() -> tuple[list, list]:
    torch.manual_seed(0)
    on = fs.units(fs.shard(TinyGPT(), policy=fs.wrap.by_type(Block)))
    off = fs.units(fs.shard(TinyGPT(), policy=fs.wrap.by_type(Block), split_root=False))
    return [u.part for u in on], [u.part for u in off]
