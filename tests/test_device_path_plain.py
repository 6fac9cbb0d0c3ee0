"""The device path is the plain one: the Gloo box's workarounds run on Gloo only.

Under the ``strict_async`` backend (Gloo underneath, NCCL's rules on top, so flatshard runs
exactly what it runs under NCCL, on the CPU) a sharded model must have no gather pool, run its
units' forwards without saved-tensor hooks, and all-gather in place (no clone of its own
chunk). Under Gloo the pool and its hooks are there, as before (see [Note: the pool only where
it pays] in features/gather_pool.py).
"""

from __future__ import annotations

import torch

import flatshard as fs
from flatshard.core.state import get_state
from flatshard.features import saved_views
from nccl_pool import strict_pools  # noqa: F401 (the fixture)
from parity_models import Block, TinyGPT, _lm_loss, _tokens


def case_device_path() -> dict:
    """Two steps of a 3-block TinyGPT: is there a pool, which saved-tensor hooks are active
    inside a block's forward, and did each all-gather hand the collective its own chunk of
    the output (in place) rather than a copy?"""
    from flatshard.testing import nccl_semantics

    gathers: list[int] = []  # storage address per tensor of each all-gather, input first

    def record(op: str, tensor: torch.Tensor) -> None:
        if op == "all_gather":
            gathers.append(tensor.untyped_storage().data_ptr())

    strict = torch.distributed.get_backend() == nccl_semantics.BACKEND
    if strict:
        nccl_semantics.add_tensor_check(record)
    try:
        torch.manual_seed(0)
        model = fs.shard(TinyGPT(layers=3), policy=fs.wrap.by_type(Block), coalesce=False)
        active: list[str] = []

        def note_hooks(module, args):
            hooks = saved_views.active_hooks()
            active.append("none" if hooks is None else "flatshard")

        model.blocks[1].ln1.register_forward_pre_hook(note_hooks)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            _lm_loss(model, _tokens(torch.Generator().manual_seed(step), 2)).backward()
            opt.step(), opt.zero_grad()
    finally:
        if strict:
            nccl_semantics.remove_tensor_check(record)
    pairs = list(zip(gathers[::2], gathers[1::2], strict=True))
    return {
        "pool": get_state(model).pool is not None,  # white-box: the pool is no public thing
        "hooks": active,
        "gathers": len(pairs),
        "in_place": all(a == b for a, b in pairs),
    }


def test_device_path_has_no_pool_no_hooks_no_clone(strict_pools):  # noqa: F811
    for rank, r in enumerate(strict_pools(2).run(case_device_path)):
        assert not r["pool"], f"rank {rank}: a gather pool on the device path"
        assert r["hooks"] == ["none", "none"], f"rank {rank}: saved-tensor hooks {r['hooks']}"
        assert r["gathers"] > 0 and r["in_place"], f"rank {rank}: {r}"


def test_gloo_keeps_its_pool(dist_pools):
    for rank, r in enumerate(dist_pools(2).run(case_device_path)):
        assert r["pool"], f"rank {rank}: no gather pool on Gloo"
        assert r["hooks"] == ["flatshard", "flatshard"], f"rank {rank}: {r['hooks']}"
