"""``fs.unshard`` (core/teardown.py): a sharded model back to the plain module it was.

On every rank of a Gloo pool (world 2 and 3): shard a copy of a model, train it a few SGD
steps on this rank's slice of the global batch while the reference trains on the whole batch,
unshard it and compare every parameter (names, shapes, tying, device, values) with the
reference; check that no hook, wrapper or attribute of flatshard is left; then shard it again
and train on, still equal to the reference. Coalesced and uncoalesced units, every strategy
but hybrid, and ``fs.checkpoint_activations``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import flatshard as fs
from parity_models import CASES, TinyGPT, rel_err

TOLERANCE = 1e-5  # fp32, plain SGD, relative to each tensor's largest element
HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
# (case, strategy, coalesce, fs.checkpoint_activations)
CONFIGS = [
    ("gpt_tied", "full_shard", True, False),
    ("gpt_tied", "full_shard", False, False),
    ("gpt_nested_units", "full_shard", True, True),
    ("gpt_tied", "shard_grad_op", False, True),
    ("lora", "no_shard", True, False),
    ("unused", "full_shard", True, False),
]


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _shard(model: nn.Module, name: str, strategy: str, coalesce: bool, ckpt: bool) -> None:
    fs.shard(model, policy=CASES[name].policy(), strategy=strategy, coalesce=coalesce)
    if ckpt:
        fs.checkpoint_activations(model, CASES[name].policy())


def _train(model: nn.Module, ref: nn.Module, name: str, steps: range) -> None:
    """SGD steps: ``model`` (sharded) on this rank's rows, ``ref`` on the whole batch."""
    case, rank, world = CASES[name], dist.get_rank(), dist.get_world_size()
    opt, ref_opt = _sgd(model), _sgd(ref)  # plain SGD: no state lost at unshard
    for step in steps:
        batch = case.batch(torch.Generator().manual_seed(step), 2 * world)
        case.loss(model, batch.chunk(world)[rank]).backward()
        case.loss(ref, batch).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()


def _tying(model: nn.Module) -> list[int]:
    """Per parameter place, the index of the first place holding the same parameter."""
    places = [id(p) for _, p in model.named_parameters(remove_duplicate=False)]
    return [places.index(i) for i in places]


def _leftovers(model: nn.Module, before: dict) -> list[str]:
    """Hooks, instance attributes and instance ``forward``s that were not there before."""
    found = []
    for name, module in model.named_modules():
        hooks = [d for d in HOOK_DICTS if len(getattr(module, d)) != before[name][0].get(d)]
        extra = set(module.__dict__) - before[name][1]
        found += [f"{name or '<root>'}: {what}" for what in (*hooks, *sorted(extra))]
    return found


def _snapshot(model: nn.Module) -> dict:
    return {
        name: ({d: len(getattr(m, d)) for d in HOOK_DICTS}, set(m.__dict__))
        for name, m in model.named_modules()
    }


def _compare(model: nn.Module, ref: nn.Module, name: str) -> dict:
    """``model`` (unsharded) against ``ref``: parameters, tying, and one plain forward."""
    mine, theirs = dict(model.named_parameters()), dict(ref.named_parameters())
    same_params = list(mine) == list(theirs) and all(
        type(mine[n]) is nn.Parameter
        and mine[n].shape == q.shape
        and mine[n].requires_grad == q.requires_grad
        and mine[n].device == q.device
        for n, q in theirs.items()
    )
    err = max(rel_err(mine[n].detach(), q.detach()) for n, q in theirs.items())
    batch = CASES[name].batch(torch.Generator().manual_seed(99), 2)
    with torch.no_grad():
        loss_err = rel_err(CASES[name].loss(model, batch), CASES[name].loss(ref, batch))
    return dict(same_params=same_params, tying=_tying(model) == _tying(ref), err=max(err, loss_err))


def case_unshard_round_trip(name: str, strategy: str, coalesce: bool, ckpt: bool) -> dict:
    """Shard, train, unshard, compare; shard again, train on, unshard, compare."""
    torch.manual_seed(0)
    ref = CASES[name].build()
    model = copy.deepcopy(ref)
    before = _snapshot(model)
    out = {}
    for round_, steps in enumerate((range(0, 3), range(3, 5))):
        _shard(model, name, strategy, coalesce, ckpt)
        _train(model, ref, name, steps)
        assert fs.unshard(model) is model
        left = _leftovers(model, before)
        out[f"round {round_}"] = {"sharded": fs.is_sharded(model), "leftovers": left}
        if left:  # a hook left behind would run in the comparison's forward
            return out
        out[f"round {round_}"].update(_compare(model, ref, name))
    return out


def case_every_config() -> list[dict]:
    return [case_unshard_round_trip(*config) for config in CONFIGS]


@pytest.mark.parametrize("world", [2, 3])
def test_unshard_gives_back_the_trained_plain_module(dist_pools, world):
    for rank, results in enumerate(dist_pools(world).run(case_every_config)):
        for config, rounds in zip(CONFIGS, results, strict=True):
            for round_, r in rounds.items():
                where = f"rank {rank} {config} {round_}"
                assert not r["sharded"] and r["leftovers"] == [], f"{where}: {r['leftovers']}"
                assert r["same_params"] and r["tying"], f"{where}: parameters differ in kind"
                assert r["err"] <= TOLERANCE, f"{where}: {r['err']:.3g} from single-process"


def test_unshard_of_a_plain_module_names_the_fix():
    with pytest.raises(ValueError, match=r"is not sharded: call fs\.shard"):
        fs.unshard(nn.Linear(2, 2))


def case_unshard_gives_the_masters() -> dict:
    """Under bf16 mixed precision with CPU offload: the fp32 masters, exactly what
    ``fs.full_state_dict`` holds, on the compute device."""
    torch.manual_seed(0)
    name = "gpt_tied"
    model = copy.deepcopy(CASES[name].build())
    mp = fs.MixedPrecision(param_dtype=torch.bfloat16)
    fs.shard(model, policy=CASES[name].policy(), mixed_precision=mp, offload=fs.CPUOffload())
    _train(model, CASES[name].build(), name, range(2))
    full = fs.full_state_dict(model)  # the mesh's first rank only
    fs.unshard(model)
    params = dict(model.named_parameters())
    exact = all(torch.equal(params[k], full[k]) for k in params) if full else True
    kinds = {(str(p.dtype), str(p.device)) for p in params.values()}
    return {"exact": exact, "kinds": sorted(kinds), "checked": bool(full)}


def test_unshard_gives_the_fp32_masters_under_mixed_precision(dist_pools):
    results = dist_pools(2).run(case_unshard_gives_the_masters)
    assert [r["checked"] for r in results] == [True, False]
    for rank, r in enumerate(results):
        assert r["exact"] and r["kinds"] == [("torch.float32", "cpu")], (rank, r)


class GPTWithEmbed(TinyGPT):
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        return self.emb(idx)


def case_unshard_restores_registered_methods() -> dict:
    """``fs.register_method``'s wrapper goes; the module's own method comes back."""
    torch.manual_seed(0)
    model = GPTWithEmbed()
    fs.shard(model, policy=CASES["gpt_tied"].policy())
    fs.register_method(model, "embed")
    idx = torch.tensor([[1, 2, 3]])
    gathered = model.embed(idx).detach()
    fs.unshard(model)
    return {"own": "embed" not in model.__dict__, "same": torch.equal(model.embed(idx), gathered)}


def test_unshard_restores_registered_methods(dist_pools):
    for rank, r in enumerate(dist_pools(2).run(case_unshard_restores_registered_methods)):
        assert r == {"own": True, "same": True}, (rank, r)
