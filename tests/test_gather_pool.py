"""Reused gather buffers (gather_pool.py, saved_views.py): few allocations, same numbers.

Parity with the pool on is what every engine test checks (it is the default); here: the buffers
really are reused and really move between units, saved views survive the move, the private
path (``FLATSHARD_GATHER_POOL=0``, foreign saved-tensor hooks) gives the same numbers.
"""

from __future__ import annotations

import copy

import pytest
import torch

import flatshard as fs
from flatshard.core.state import get_state
from parity_models import Block, TinyGPT, _lm_loss, _tokens, train_parity
from patching import patched_env


def _sharded(
    layers: int = 5, prefetch: fs.Prefetch | None = None
) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    ref = TinyGPT(layers=layers)
    # Coalesced units gather into private buffers (features/buckets.py): the pool is tested
    # unit by unit.
    model = fs.shard(
        copy.deepcopy(ref), policy=fs.wrap.by_type(Block), prefetch=prefetch, coalesce=False
    )
    return ref, model


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None and p.grad.numel()]


def case_buffers_are_reused() -> dict[str, object]:
    _, model = _sharded(layers=5)
    # white-box: a spy on the pool's acquire, and the buffers behind flatshard's count
    state = get_state(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    allocations, gathers, addresses, accounts = [], [], [], []
    for step in range(5):
        fs.comm_stats(model, reset=True)
        before = fs.memory_stats(model).pool_allocations
        seen = set()
        original = state.pool.acquire

        def spy(*args, original=original, seen=seen, **kwargs):
            buf = original(*args, **kwargs)
            seen.add(buf.untyped_storage().data_ptr())
            return buf

        state.pool.acquire = spy
        _lm_loss(model, _tokens(torch.Generator().manual_seed(step), 2)).backward()
        opt.step(), opt.zero_grad()
        del state.pool.acquire
        memory = fs.memory_stats(model)
        allocations.append(memory.pool_allocations - before)
        held = sum(b.untyped_storage().nbytes() for b in state.gathered_buffers())
        accounts.append((memory.gathered_bytes, held, memory.gathered_peak_bytes))
        gathers.append(fs.comm_stats(model).calls["all_gather"])
        addresses.append(len(seen))
    return {
        "allocations": allocations,
        "gathers": gathers,
        "buffers_used": addresses,
        "accounts": accounts,
        "block_bytes": fs.units(model)[0].full_bytes,
    }


def test_gather_buffers_are_reused(dist_pools):
    for r in dist_pools(2).run(case_buffers_are_reused):
        # From the second step on (the first records the order: no prefetch), two buffers per
        # step are allocated for 12 gathers: every buffer is dropped at the end of forward
        # (the last block too: with the root's tail split off, the tail starts the backward
        # and prefetches it), and backward needs the last block's and the next one's.
        assert r["allocations"][2:] == [2, 2, 2], r
        assert min(r["gathers"][1:]) >= 12, r
        # and the 5 blocks share 2-4 buffers, so a regather lands elsewhere than the forward's
        assert max(r["buffers_used"][1:]) <= 4, r
        # flatshard's own count of gathered bytes agrees with the buffers it holds; between
        # steps it keeps the two free buffers of the backward (the root is released)
        for current, held, peak in r["accounts"]:
            assert current == held and peak >= held, r
        assert r["accounts"][-1][0] == 2 * r["block_bytes"], r


def pool_off_parity(name: str):
    with patched_env(FLATSHARD_GATHER_POOL="0"):
        return train_parity(name, coalesce=False)


@pytest.mark.parametrize("name", ["gpt_tied", "gpt_nested_units", "lora"])
def test_private_buffers_match_single_process(dist_pools, name):
    r = dist_pools(2).run(pool_off_parity, name)[0]
    assert r["grad_err"] <= 1e-5 and r["sd_err"] <= 1e-5 and r["loss_err"] <= 1e-5, r


def case_foreign_saved_tensor_hooks() -> dict[str, list]:
    """A forward under ``save_on_cpu`` (someone else's saved-tensor hooks) moves units to their
    private buffers; gradients equal those of the same model trained without the hooks."""
    _, plain = _sharded(layers=4)
    _, hooked = _sharded(layers=4)
    out: dict[str, list] = {"grad_diff": [], "private_during": [], "private_after": []}
    for step in range(3):
        batch = _tokens(torch.Generator().manual_seed(step), 2)
        _lm_loss(plain, batch).backward()
        with torch.autograd.graph.save_on_cpu():
            loss = _lm_loss(hooked, batch)
        out["private_during"].append(_private_groups(hooked))
        loss.backward()
        out["private_after"].append(_private_groups(hooked))
        pairs = zip(_grads(plain), _grads(hooked), strict=True)
        out["grad_diff"].append(max((a - b).abs().max().item() for a, b in pairs))
        plain.zero_grad(), hooked.zero_grad()
    return out


def _private_groups(model: torch.nn.Module) -> int:
    # white-box: the groups moved to their private buffer (the pool's fallback, not reported)
    return sum(g.keep_private for u in get_state(model).units for g in u.groups)


def test_foreign_saved_tensor_hooks_keep_working(dist_pools):
    for r in dist_pools(2).run(case_foreign_saved_tensor_hooks):
        assert all(n > 0 for n in r["private_during"]), r  # the hooked forwards went private
        assert r["private_after"] == [0, 0, 0], r  # pooled again once the backward is over
        assert r["grad_diff"] == [0.0, 0.0, 0.0], r  # the same arithmetic: bit-identical


def case_deep_model_gradients(layers: int, forward: int = 1, backward: str = "pre") -> list[float]:
    """Gradients of every step against the single-process model, for a model deep enough that
    a block's backward regather lands in a different buffer than its forward gather (with 3
    blocks the ping-pong happens to give each block its forward buffer back)."""
    from parity_models import _max_grad_err

    ref, model = _sharded(layers, fs.Prefetch(forward=forward, backward=backward))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    errors = []
    for step in range(4):
        batch = _tokens(torch.Generator().manual_seed(step), 2 * world)
        _lm_loss(model, batch.chunk(world)[rank]).backward()
        _lm_loss(ref, batch).backward()
        errors.append(_max_grad_err(model, ref))
        for o in (opt, ref_opt):
            o.step(), o.zero_grad()
    return errors


@pytest.mark.parametrize("world", [2, 3])
def test_saved_views_follow_the_buffer_moves(dist_pools, world):
    for errors in dist_pools(world).run(case_deep_model_gradients, 6):
        assert max(errors) <= 1e-5, errors


@pytest.mark.parametrize("forward, backward", [(0, "none"), (2, "post"), (3, "pre")])
def test_saved_views_with_other_prefetch_depths(dist_pools, forward, backward):
    for errors in dist_pools(2).run(case_deep_model_gradients, 7, forward, backward):
        assert max(errors) <= 1e-5, errors


class Consumer(torch.nn.Module):
    """A unit of model B that multiplies by a weight it is handed (model A's parameter)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) @ w  # saves the view of A's gathered weight


class Producer(torch.nn.Module):
    """A unit of model A that calls a unit of model B (kept out of A's modules) with its
    own parameter."""

    def __init__(self, d: int, consumers: list) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(d, d) / d**0.5)
        self.consumers, self.index = consumers, len(consumers) - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.consumers[self.index](x, self.w)


def _two_models(d: int = 16, depth: int = 6) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    consumers: list = []
    b = torch.nn.ModuleList()
    a = torch.nn.Sequential()
    for _ in range(depth):
        consumers.append(Consumer(d))
        b.append(consumers[-1])
        a.append(Producer(d, consumers))
    return a, torch.nn.Sequential(b)  # B's root holds its units


def case_parameter_passed_to_another_sharded_model() -> list[float]:
    """Model A's unit hands its parameter to a unit of model B (both sharded, both pooled):
    the view saved inside B's forward belongs to A's pool and must follow A's buffer moves."""
    from parity_models import _max_grad_err

    ref_a, ref_b = _two_models()
    a, b = _two_models()
    fs.shard(b, policy=fs.wrap.by_type(Consumer), coalesce=False)
    fs.shard(a, policy=fs.wrap.by_type(Producer), coalesce=False)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    opts = [torch.optim.SGD([*m.parameters()], lr=0.1) for m in (a, b, ref_a, ref_b)]
    errors = []
    for step in range(4):
        x = torch.randn(4 * world, 16, generator=torch.Generator().manual_seed(step))
        a(x.chunk(world)[rank]).pow(2).mean().backward()
        ref_a(x).pow(2).mean().backward()
        errors.append(max(_max_grad_err(a, ref_a), _max_grad_err(b, ref_b)))
        for o in opts:
            o.step(), o.zero_grad()
    return errors


def test_parameter_passed_to_another_sharded_model(dist_pools):
    for errors in dist_pools(2).run(case_parameter_passed_to_another_sharded_model):
        assert max(errors) <= 1e-5, errors
