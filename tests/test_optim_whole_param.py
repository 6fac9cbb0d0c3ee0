"""fs.optim.Muon and fs.optim.Adafactor on sharded models equal torch's optimizers unsharded.

Every strategy at world 2 and 3 (hybrid_shard at 4 = 2 x 2), models with empty fragments of
optimised parameters on some rank, unused parameters (no gradient anywhere), 4 steps, 1e-5.
Muon's reference gets the sharded run's reduced gradient bits (see whole_param_parity.py:
torch's bf16 Newton–Schulz turns gradient rounding into ~5e-5 differences between any two
unsharded runs); Adafactor (fp32 throughout) runs free, each side on its own gradient.
"""

from __future__ import annotations

import pytest
import torch

import flatshard as fs
from parity_models import VOCAB, Block, TinyGPT
from whole_param_parity import optimizer_parity

TOL = 1e-5
MODELS = ["gpt_tied", "unused", "lora"]


def _matrix(shape: torch.Size) -> bool:
    return len(shape) == 2


def _any(shape: torch.Size) -> bool:
    return True


def _muon(params):
    return fs.optim.Muon(params, lr=0.02, weight_decay=0.1, nesterov=True)


def _muon_ref(params):
    return torch.optim.Muon(params, lr=0.02, weight_decay=0.1, nesterov=True)


def _muon_plain(params):  # no Nesterov, Moonshot's LR rule: the other branches
    return fs.optim.Muon(
        params, lr=0.01, momentum=0.9, nesterov=False, adjust_lr_fn="match_rms_adamw"
    )


def _muon_plain_ref(params):
    return torch.optim.Muon(
        params, lr=0.01, momentum=0.9, nesterov=False, adjust_lr_fn="match_rms_adamw"
    )


ADAFACTOR = dict(lr=0.01, weight_decay=0.1)
ADAFACTOR_MAX = dict(lr=0.02, beta2_decay=-0.5, eps=(1e-30, 1e-3), d=1.5, maximize=True)


def _adafactor(params):
    return fs.optim.Adafactor(params, **ADAFACTOR)


def _adafactor_ref(params):
    return torch.optim.Adafactor(params, **ADAFACTOR)


def _adafactor_max(params):
    return fs.optim.Adafactor(params, **ADAFACTOR_MAX)


def _adafactor_max_ref(params):
    return torch.optim.Adafactor(params, **ADAFACTOR_MAX)


# label -> (sharded factory, reference factory, which full shapes, handoff)
RUNS = {
    "muon": (_muon, _muon_ref, _matrix, True),
    "muon_plain": (_muon_plain, _muon_plain_ref, _matrix, True),
    "adafactor": (_adafactor, _adafactor_ref, _any, False),
    "adafactor_max": (_adafactor_max, _adafactor_max_ref, _any, False),
}


# (strategy, model) pairs: gpt_tied (a tied embedding/head, empty matrix fragments) under
# full_shard with every run, the small models (unused parameters, frozen neighbours, empty
# fragments) under every strategy; the variant runs (other branches) on gpt_tied only.
PLAN = {
    2: [("full_shard", "gpt_tied"), ("full_shard", "lora"), ("shard_grad_op", "unused"),
        ("no_shard", "lora")],
    3: [("full_shard", "gpt_tied"), ("full_shard", "unused"), ("shard_grad_op", "lora"),
        ("no_shard", "unused")],
    4: [("hybrid_shard", "lora"), ("hybrid_shard", "unused")],
}  # fmt: skip


def case_whole_param(world: int) -> dict:
    out = {}
    for strategy, model in PLAN[world]:
        for label, (make, make_ref, select, handoff) in RUNS.items():
            variant = label.endswith(("_plain", "_max"))
            if variant and model != "gpt_tied":
                continue
            out[f"{label} {model} {strategy}"] = optimizer_parity(
                model, strategy, make, make_ref, select=select, handoff=handoff
            )
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_whole_param_optimizers_match_torch_unsharded(dist_pools, world):
    results = dist_pools(world).run(case_whole_param, world)
    failures = []
    print(f"\nworld {world}: params / state / grad rel err")
    for label, r0 in results[0].items():
        per_rank = [r[label] for r in results]
        grad = max(r["grad_err"] for r in per_rank)
        empty = [r["empty"] for r in per_rank]
        print(f"  {label:34s} {r0['sd_err']:.1e} {r0['state_err']:.1e} {grad:.1e} empty {empty}")
        if max(r0["sd_err"], r0["state_err"], grad) > TOL:
            failures.append(f"{label} at world {world}: {r0}, grad {grad:.2e}")
    assert not failures, "\n".join(failures)
    if world in (2, 3):  # the hard case is there: an optimised fragment empty on some rank
        empties = {label: [r[label]["empty"] for r in results] for label in results[0]}
        assert any(sum(e) for e in empties.values()), f"no empty fragment at world {world}"


def _error(fn) -> str:
    try:
        fn()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "accepted"


def _torch_step(model, make) -> None:
    model(torch.randint(0, VOCAB, (2, 5))).sum().backward()
    make(model).step()


def _torch_muon_with_fragments(model):
    opt = torch.optim.Muon([torch.nn.Parameter(torch.zeros(2, 2))])
    opt.add_param_group({"params": list(model.parameters())})  # past torch's 1-D check
    return opt


def case_refusals() -> dict:
    model = fs.shard(TinyGPT(layers=1), policy=fs.wrap.by_type(Block))
    other = fs.shard(TinyGPT(layers=1), policy=fs.wrap.by_type(Block))
    matrices, others = fs.optim.muon_split(model)
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        "muon_1d": _error(lambda: fs.optim.Muon(model.parameters())),
        "two_models": _error(
            lambda: fs.optim.Adafactor([*model.parameters(), *other.parameters()])
        ),
        "torch_adafactor": _error(
            lambda: _torch_step(model, lambda m: torch.optim.Adafactor(m.parameters()))
        ),
        "torch_muon": _error(lambda: _torch_step(model, _torch_muon_with_fragments)),
        "matrices": sorted(names[id(p)] for p in matrices),
        "others": sorted(names[id(p)] for p in others),
    }


def test_refusals_name_the_parameter_and_the_fix(dist_pools):
    r = dist_pools(2).run(case_refusals)[0]
    assert r["muon_1d"].startswith("ValueError: fs.optim.Muon: param group 0"), r["muon_1d"]
    assert "of full shape (" in r["muon_1d"] and "muon_split" in r["muon_1d"]
    assert "sharded model(s)" in r["two_models"], r["two_models"]
    assert "use fs.optim.adafactor" in r["torch_adafactor"].lower(), r["torch_adafactor"]
    assert "use fs.optim.muon" in r["torch_muon"].lower(), r["torch_muon"]
    # Muon's authors: hidden matrices only; the tied embedding/head and 1-D tensors go to AdamW
    assert r["matrices"] == sorted(
        f"blocks.0.{n}.weight" for n in ("qkv", "proj", "mlp.fc", "mlp.out")
    ), r["matrices"]
    assert "emb.weight" in r["others"] and "blocks.0.ln1.weight" in r["others"]
