"""``fs.GradScaler``: the scale schedule (single process, against ``torch.amp.GradScaler``) and
the shared skip decision on Gloo pools (``case_*`` functions run on every rank)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import flatshard as fs
from flatshard.optim.grad_scaler import GradScaler

D, H = 8, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(D, H), nn.Linear(H, 1)
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


# ---- the schedule, single process ------------------------------------------------------------


def _step(scaler, model: nn.Module, opt: torch.optim.Optimizer, bad: float | None = None) -> None:
    opt.zero_grad()
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    if bad is not None:
        model.weight.grad[0, 0] = bad
    scaler.step(opt)
    scaler.update()


def _linear() -> tuple[nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_schedule_and_skips_match_torch_amp():
    ours, theirs = _linear(), _linear()
    scaler = GradScaler(init_scale=2.0**10, growth_interval=3)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    pattern = [None, None, None, float("inf"), None, float("nan"), None, None, None, None]
    for bad in pattern:
        _step(scaler, *ours, bad)
        _step(ref, *theirs, bad)
        assert scaler.get_scale() == ref.get_scale()
        assert scaler.last_step_skipped == (bad is not None)
    for p, q in zip(ours[0].parameters(), theirs[0].parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert scaler.get_scale() == 2.0**10  # grew, halved, halved, grew


def test_hysteresis_backs_off_after_n_consecutive_overflows():
    model, opt = _linear()
    scaler = GradScaler(init_scale=64.0, hysteresis=3, growth_interval=100)
    scales = []
    for bad in [1, 1, None, 1, 1, 1, 1, None, 1]:  # 1 = an overflowing step
        before = model.weight.detach().clone()
        _step(scaler, model, opt, float("inf") if bad else None)
        assert torch.equal(before, model.weight) == bool(bad)  # every overflow skips
        scales.append(scaler.get_scale())
    # a clean step resets the streak; the 3rd overflow in a row halves, and so does the 4th
    assert scales == [64, 64, 64, 64, 64, 32, 16, 16, 16]


def test_overflow_at_min_scale_raises_a_clear_error():
    model, opt = _linear()
    scaler = GradScaler(init_scale=4.0, min_scale=1.0)
    _step(scaler, model, opt, float("inf"))
    _step(scaler, model, opt, float("inf"))
    assert scaler.get_scale() == 1.0
    with pytest.raises(RuntimeError, match=r"minimum loss scale.*min_scale=1.*bf16"):
        _step(scaler, model, opt, float("inf"))


def test_state_dict_round_trip_and_torch_state_dicts():
    model, opt = _linear()
    scaler = GradScaler(init_scale=2.0**8, growth_interval=4, hysteresis=2)
    for bad in [None, None, float("inf")]:
        _step(scaler, model, opt, bad)
    state = scaler.state_dict()
    assert state["_overflow_streak"] == 1 and state["_growth_tracker"] == 0
    again = GradScaler()
    again.load_state_dict(state)
    assert again.state_dict() == state
    for s in (scaler, again):  # the second overflow in a row halves both the same way
        _step(s, *_linear(), float("inf"))
    assert again.get_scale() == scaler.get_scale() == 2.0**7
    torch_state = torch.amp.GradScaler("cpu", init_scale=32.0, growth_interval=7).state_dict()
    again.load_state_dict(torch_state)
    assert again.get_scale() == 32.0 and again.state_dict()["growth_interval"] == 7
    with pytest.raises(RuntimeError, match="empty"):
        again.load_state_dict(GradScaler(enabled=False).state_dict())


def test_misuse_is_reported():
    model, opt = _linear()
    scaler = GradScaler()
    with pytest.raises(RuntimeError, match="No inf checks"):
        scaler.update()
    scaler.scale(model(torch.ones(1, 4)).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)
    scaler.update()
    with pytest.raises(TypeError, match=r"GradScaler\.scale"):
        scaler.scale("loss")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"growth_factor": 1.0}, "growth_factor=1.0"),
        ({"backoff_factor": 1.5}, "backoff_factor=1.5"),
        ({"growth_interval": 0}, "growth_interval=0"),
        ({"hysteresis": 1.5}, "hysteresis=1.5"),
        ({"min_scale": 0.0}, "min_scale=0.0"),
        ({"init_scale": 0.5}, "init_scale=0.5"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GradScaler(**kwargs)


def test_disabled_is_a_pass_through():
    model, opt = _linear()
    scaler = GradScaler(enabled=False)
    loss = model(torch.ones(1, 4)).sum()
    assert scaler.scale(loss) is loss and scaler.get_scale() == 1.0
    loss.backward()
    before = model.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(before, model.weight) and scaler.state_dict() == {}


def test_scaled_fp16_loss_is_upcast():
    scaler = GradScaler()
    scaled = scaler.scale(torch.tensor(3.0, dtype=torch.float16))
    assert scaled.dtype == torch.float32 and scaled.item() == 3.0 * 2**16  # not inf


# ---- every rank skips together ---------------------------------------------------------------


def _global_batch(step: int, rows: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, D, generator=gen), torch.randn(rows, 1, generator=gen)


def _local(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    rank, world = dist.get_rank(), dist.get_world_size()
    return tuple(t.chunk(world)[rank] for t in batch)


def _poison_on_last_rank(model: nn.Module, value: float) -> None:
    if dist.get_rank() == dist.get_world_size() - 1:
        p = next(p for p in model.parameters() if p.grad is not None and p.grad.numel())
        p.grad[0] = value


def case_one_rank_overflows(strategy: str, bad: float) -> dict:
    torch.manual_seed(0)
    model = fs.shard(Net().half(), policy=fs.wrap.by_type(Block), strategy=strategy)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = GradScaler(init_scale=2.0**8, growth_interval=1000)
    out: dict[str, list] = {"changed": [], "scale": [], "skipped": [], "returned": []}
    for step in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        x, y = _local(_global_batch(step))
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(x.half()).float(), y)).backward()
        if step == 1:
            _poison_on_last_rank(model, bad)
        out["returned"].append(scaler.step(opt))
        scaler.update()
        after = list(model.parameters())
        out["changed"].append(
            any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
        )
        out["scale"].append(scaler.get_scale())
        out["skipped"].append(scaler.last_step_skipped)
    out["found_inf_all_reduces"] = scaler.stats.calls["found_inf"]
    return out


@pytest.mark.parametrize(
    "world, strategy, bad",
    [(2, "full_shard", float("inf")), (3, "full_shard", float("nan")), (2, "no_shard", -1e9)],
)
def test_inf_on_one_rank_makes_every_rank_skip(dist_pools, world, strategy, bad):
    # -1e9 overflows fp16 itself: an fp16 gradient written with it holds -inf
    for r in dist_pools(world).run(case_one_rank_overflows, strategy, bad):
        assert r["skipped"] == [False, True, False]
        assert r["changed"] == [True, False, True]  # no rank stepped alone, nothing hung
        assert r["scale"] == [256.0, 128.0, 128.0]
        assert r["returned"][1] is None
        assert r["found_inf_all_reduces"] == 3  # one single-float all-reduce per step


def case_unscale_then_clip() -> dict[str, float]:
    torch.manual_seed(0)
    ref = Net().half()
    scaled = fs.shard(copy.deepcopy(ref), policy=fs.wrap.by_type(Block))
    plain = fs.shard(ref, policy=fs.wrap.by_type(Block))
    x, y = _local(_global_batch(0))
    scaler = GradScaler(init_scale=2.0**10)
    opt = torch.optim.SGD(scaled.parameters(), lr=0.05)
    scaler.scale(F.mse_loss(scaled(x.half()).float(), y)).backward()
    scaler.unscale_(opt)
    norm = fs.clip_grad_norm_(scaled, 0.01)
    after = fs.clip_grad_norm_(scaled, 1e9)  # the norm after clipping
    F.mse_loss(plain(x.half()).float(), y).backward()
    ref_norm = fs.clip_grad_norm_(plain, 1e9)
    before = [p.detach().clone() for p in scaled.parameters()]
    scaler.step(opt)
    scaler.update()
    moved = any(not torch.equal(a, b) for a, b in zip(scaled.parameters(), before, strict=True))
    return {"norm": norm.item(), "ref": ref_norm.item(), "after": after.item(), "moved": moved}


def test_unscale_then_clip_grad_norm(dist_pools):
    for r in dist_pools(2).run(case_unscale_then_clip):
        assert abs(r["norm"] / r["ref"] - 1) < 1e-3  # the unscaled norm (2**k scaling is exact)
        assert r["after"] <= 0.01 * 1.01 and r["moved"]


def case_parity_with_torch_amp() -> dict[str, list[float]]:
    """fp32 parameters, fp16 autocast: sharded + fs.GradScaler vs one process + torch's."""
    torch.manual_seed(0)
    ref = Net()
    model = fs.shard(copy.deepcopy(ref), policy=fs.wrap.by_type(Block))
    kwargs = {"init_scale": 2.0**8, "growth_interval": 2}
    runs = [
        (model, torch.optim.AdamW(model.parameters(), lr=1e-2), GradScaler(**kwargs), True),
        (ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.amp.GradScaler("cpu", **kwargs)),
    ]
    out: dict[str, list[float]] = {"loss": [], "ref_loss": [], "scale": [], "ref_scale": []}
    for step in range(6):
        batch = _global_batch(step)
        for net, opt, scaler, *sharded in runs:
            x, y = _local(batch) if sharded else batch
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(net(x).float(), y)
            scaler.scale(loss).backward()
            if step == 3 and sharded:  # one rank overflows; the reference sees it "globally"
                _poison_on_last_rank(net, float("inf"))
            elif step == 3:
                _poison(net)
            scaler.step(opt)
            scaler.update()
            loss = loss.detach()
            if sharded:
                dist.all_reduce(loss)
                loss /= dist.get_world_size()
            out["loss" if sharded else "ref_loss"].append(loss.item())
            out["scale" if sharded else "ref_scale"].append(scaler.get_scale())
    return out


def _poison(model: nn.Module) -> None:
    next(model.parameters()).grad.view(-1)[0] = float("inf")


@pytest.mark.parametrize("world", [2, 3])
def test_parity_with_torch_amp_grad_scaler(dist_pools, world):
    for r in dist_pools(world).run(case_parity_with_torch_amp):
        assert r["scale"] == r["ref_scale"] == [256, 512, 512, 256, 256, 512]
        for a, b in zip(r["loss"], r["ref_loss"], strict=True):
            assert abs(a / b - 1) < 1e-3  # measured 5e-5 (fp16 autocast, world 2)


def case_debug_switch_comes_from_the_model() -> dict[str, bool]:
    """FLATSHARD_DEBUG is the model's, as its fs.shard read it: a scaler built before fs.shard
    in another environment, stepping after the environment changed again, follows the model."""
    from patching import patched_env

    scaler = GradScaler()  # no FLATSHARD_DEBUG here
    torch.manual_seed(0)
    with patched_env(FLATSHARD_DEBUG="1"):
        model = fs.shard(Net(), policy=fs.wrap.by_type(Block))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _local(_global_batch(0))
    scaler.scale(F.mse_loss(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    checking = scaler.stats.checker is not None
    plain = GradScaler()  # plain parameters, no sharded model: the environment at its step
    with patched_env(FLATSHARD_DEBUG="1"):
        reference = torch.nn.Linear(2, 1)
        plain_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
        plain.scale(reference(torch.ones(1, 2)).sum()).backward()
        plain.step(plain_opt)
        plain.update()
    return {"model": checking, "plain": plain.stats.checker is not None}


def test_the_debug_switch_comes_from_the_sharded_model(dist_pools):
    for r in dist_pools(2).run(case_debug_switch_comes_from_the_model):
        assert r == {"model": True, "plain": True}, r
