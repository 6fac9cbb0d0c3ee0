"""One post-forward for plain units and buckets (see [Note: one post-forward] in core/hooks.py).

A model sharded as coalesced buckets and as plain units trains side by side with the
single-process model: both layouts must match it (and each other bit for bit over two ranks),
and after every forward the same units must be released or kept: without a tail the last
unit of the forward is kept for the backward, which starts with it; with the root's tail
split off (its backward comes first) the last block or bucket is released before the loss.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import flatshard as fs
from flatshard.core.state import get_state
from flatshard.core.unit import ParamState, UnitRole
from parity_models import Block, TinyGPT, _lm_loss, _tokens, rel_err, state_dict_err

STEPS = 3
BLOCKS = [f"blocks.{i}" for i in range(4)]
LAYOUTS = {
    "buckets": fs.Coalesce(unit_bytes=0, buckets=[BLOCKS[:2], BLOCKS[2:]]),
    "units": False,
}


def _kept_after_forward(model: torch.nn.Module) -> list[str]:
    """The units still gathered after the forward, by what they are (white-box: the state of
    each unit is what the post-forward decided)."""
    out = []
    for unit in get_state(model).units:
        if unit.state is ParamState.SHARDED:
            continue
        if unit.role is not UnitRole.BLOCK:
            out.append(unit.role.value)
        else:
            out.append("last" if unit is get_state(model).forward_order.frozen[-1] else "other")
    return sorted(out)


def case_layouts(split_root: bool) -> dict:
    """Both layouts and the single-process model, ``STEPS`` SGD steps on the same data."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = TinyGPT(layers=4)
    models = {
        name: fs.shard(
            copy.deepcopy(ref),
            policy=fs.wrap.by_type(Block),
            coalesce=coalesce,
            split_root=split_root,
        )
        for name, coalesce in LAYOUTS.items()
    }
    opts = {name: torch.optim.SGD(m.parameters(), lr=0.1) for name, m in models.items()}
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses: dict[str, list[float]] = {name: [] for name in [*models, "ref"]}
    kept: dict[str, list] = {name: [] for name in models}
    for step in range(STEPS):
        batch = _tokens(torch.Generator().manual_seed(step), 2 * world)
        for name, model in models.items():
            loss = _lm_loss(model, batch.chunk(world)[rank])
            kept[name].append(_kept_after_forward(model) if step else None)
            loss.backward()
            opts[name].step(), opts[name].zero_grad()
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            losses[name].append(loss.item() / world)
        ref_loss = _lm_loss(ref, batch)
        ref_loss.backward()
        ref_opt.step(), ref_opt.zero_grad()
        losses["ref"].append(ref_loss.item())
    sd_err = {name: state_dict_err(m, ref) for name, m in models.items()}
    buckets = sum(u.merged for u in get_state(models["buckets"]).units)
    a, b = (fs.full_state_dict(m) for m in models.values())
    between = max((rel_err(a[k], b[k]) for k in a), default=0.0)
    return {
        "losses": losses,
        "kept": kept,
        "sd_err": sd_err,
        "between": between,
        "buckets": buckets,
    }


@pytest.mark.parametrize(
    "split_root, expected",
    [
        # The root (and its tail) are kept from forward into backward, the other blocks are
        # released. No tail: the last unit is kept too (the backward starts with it).
        (False, ["last", "root"]),
        # A tail: its backward comes first, so the last block or bucket is released as well.
        (True, ["root", "tail"]),
    ],
)
def test_buckets_and_units_release_alike_and_match_one_process(dist_pools, split_root, expected):
    results = dist_pools(2).run(case_layouts, split_root)
    r = results[0]
    assert r["buckets"] == 2, r
    for rank, res in enumerate(results):
        for layout, per_step in res["kept"].items():
            for step, kept in enumerate(per_step[1:], start=1):
                assert kept == expected, f"rank {rank} {layout} step {step}: kept {kept}"
    for layout, err in r["sd_err"].items():
        assert err <= 1e-5, f"{layout}: parameters vs one process, rel err {err:.2e}"
    ref = r["losses"]["ref"]
    for layout in LAYOUTS:
        diffs = [abs(x - y) for x, y in zip(r["losses"][layout], ref, strict=True)]
        assert max(diffs) <= 1e-5, f"{layout}: losses {r['losses'][layout]} vs {ref}"
    # Over two ranks a reduce-scatter SUM gives the same bits in either layout.
    assert r["losses"]["buckets"] == r["losses"]["units"], r["losses"]
    assert r["between"] == 0.0, r["between"]
