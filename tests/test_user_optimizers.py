"""Every elementwise ``torch.optim`` optimizer steps on flatshard's 1-D fragments as on the full
parameters.

After ``fs.shard`` the optimizer sees this rank's 1-D fragment of every parameter (possibly
empty: every model here has empty trainable fragments on some rank at world 2 and 3, checked
below). An elementwise optimizer (its update of an element depends only on that element's
gradient and state) must then give the single-process result on the global batch. Each
optimizer runs in its ``foreach=False`` ("loop"), ``foreach=True`` and, where torch has a CPU
kernel, ``fused=True`` implementations: each variant against the same variant unsharded, and the
sharded foreach/fused run against the unsharded loop run (the result must not depend on the
implementation either). Same tolerance as the engine parity tests (``check_parity``, 1e-5).
All the (optimizer, variant) runs of one (model, world) are one pool job.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import flatshard as fs
from flatshard.core.params import is_fragment
from parity_models import CASES, check_parity, train_parity

STEPS = 4

# key -> (class, hyper-parameters). The parameter groups bring their own weight_decay (0.1 for
# weights, 0 for biases and norms), dropped for the optimizers without one (Rprop). Learning
# rates are modest: 4 steps stay well-conditioned, far from the noise floor.
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict]] = {
    "sgd": (torch.optim.SGD, dict(lr=0.05)),
    "sgd_momentum": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1)),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    "adam": (torch.optim.Adam, dict(lr=1e-3)),  # coupled (L2) weight decay
    "adam_amsgrad": (torch.optim.Adam, dict(lr=1e-3, amsgrad=True)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-3)),
    "adamax": (torch.optim.Adamax, dict(lr=2e-3)),
    "nadam": (torch.optim.NAdam, dict(lr=1e-3)),
    "nadam_decoupled": (torch.optim.NAdam, dict(lr=1e-3, decoupled_weight_decay=True)),
    "radam": (torch.optim.RAdam, dict(lr=1e-3)),
    "radam_decoupled": (torch.optim.RAdam, dict(lr=1e-3, decoupled_weight_decay=True)),
    # RMSprop has no bias correction: its first steps move every element by about
    # lr / sqrt(1 - alpha) = 10 lr, so lr=1e-4 is the step size Adam's 1e-3 is. At lr=1e-3 the
    # sharded gradients still match to 5e-7 at every step (checked with the parameters re-synced
    # after each step), but the sign-like updates amplify that rounding noise step after step:
    # centered + momentum on gpt_tied reaches 1.6e-5 at world 3 (an unsharded run that only sums
    # the batch in chunks drifts by 4.7e-6 the same way).
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-4)),
    "rmsprop_centered_momentum": (
        torch.optim.RMSprop,
        dict(lr=1e-4, centered=True, momentum=0.9),
    ),
    "adagrad": (torch.optim.Adagrad, dict(lr=1e-2, lr_decay=0.01, initial_accumulator_value=0.1)),
    "adadelta": (torch.optim.Adadelta, dict(lr=1.0)),
    "rprop": (torch.optim.Rprop, dict(lr=1e-3)),
    "asgd": (torch.optim.ASGD, dict(lr=1e-2, t0=2)),  # t0=2: averaging starts within the run
}

# Optimizers with a fused CPU kernel in torch 2.13 (``test_fused_variants_cover_torch`` keeps
# this list honest when torch changes).
FUSED = {"sgd", "sgd_momentum", "sgd_nesterov", "adam", "adam_amsgrad", "adamw", "adagrad"}
VARIANT_KWARGS = {
    "loop": dict(foreach=False),
    "foreach": dict(foreach=True),
    "fused": dict(fused=True),
}


def _variants(key: str) -> list[str]:
    return ["loop", "foreach", "fused"] if key in FUSED else ["loop", "foreach"]


# "key:variant": the sharded copy and the reference both run that variant; "key:variant~loop":
# the sharded copy runs it, the reference the plain loop (the result must not depend on it).
LOOP = [f"{key}:loop" for key in OPTIMIZERS]
EVERY_VARIANT = [f"{key}:{v}" for key in OPTIMIZERS for v in _variants(key)]
VS_LOOP = [f"{key}:{v}~loop" for key in OPTIMIZERS for v in _variants(key) if v != "loop"]

# test id -> (model, world, labels). Models: gpt_tied (a tied embedding/head, layer norms, tiny
# biases), lora (frozen parameters next to trainable ones in a unit), unused (parameters whose
# ``.grad`` stays None, skipped by every optimizer on every rank alike). Every variant on the
# small models at both worlds, the variant-independence runs once per world; the transformer
# (twice the cost of a small model) with every optimizer's loop at world 2 and every variant at
# world 3: 270 runs of 4 steps.
PLAN = {
    "lora-w2": ("lora", 2, EVERY_VARIANT + VS_LOOP),
    "lora-w3": ("lora", 3, EVERY_VARIANT),
    "unused-w2": ("unused", 2, EVERY_VARIANT),
    "unused-w3": ("unused", 3, EVERY_VARIANT + VS_LOOP),
    "gpt_tied-w2": ("gpt_tied", 2, LOOP),
    "gpt_tied-w3": ("gpt_tied", 3, EVERY_VARIANT),
}


def build_optimizer(key: str, variant: str, groups: list[dict]) -> torch.optim.Optimizer:
    cls, hyper = OPTIMIZERS[key]
    if "weight_decay" not in inspect.signature(cls).parameters:
        groups = [{k: v for k, v in g.items() if k != "weight_decay"} for g in groups]
    return cls(groups, **hyper, **VARIANT_KWARGS[variant])


class _Factory:
    """``optimizer=`` for ``train_parity``: builds the sharded copy's optimizer (every parameter
    a flatshard fragment) with one variant and the reference's (plain parameters) with
    another."""

    def __init__(self, label: str) -> None:
        self.key, variants = label.split(":")
        self.sharded, _, ref = variants.partition("~")
        self.ref = ref or self.sharded
        self.built: list[str] = []

    def __call__(self, groups: list[dict]) -> torch.optim.Optimizer:
        sharded = all(is_fragment(p) for g in groups for p in g["params"])
        self.built.append("sharded" if sharded else "reference")
        return build_optimizer(self.key, self.sharded if sharded else self.ref, groups)


def _empty_trainable_fragments(name: str) -> list[str]:
    case = CASES[name]
    torch.manual_seed(0)
    model = fs.shard(case.build(), policy=case.policy())
    return [n for n, p in model.named_parameters() if p.requires_grad and p.numel() == 0]


def case_optimizers(labels: list[str], name: str) -> dict:
    """Per rank: {label: train_parity result} for every label on model ``name``, and under
    "empty" this rank's empty trainable fragments."""
    out: dict = {"empty": _empty_trainable_fragments(name)}
    for label in labels:
        factory = _Factory(label)
        out[label] = train_parity(name, STEPS, 2, "full_shard", False, optimizer=factory)
        assert sorted(factory.built) == ["reference", "sharded"], (label, factory.built)
    return out


@pytest.mark.parametrize("plan", PLAN)
def test_elementwise_optimizers_match_single_process(dist_pools, plan):
    name, world, labels = PLAN[plan]
    results = dist_pools(world).run(case_optimizers, labels, name)
    assert any(r["empty"] for r in results), f"{name} at world {world}: no empty fragment"
    failures, worst = [], {}
    for label in labels:
        per_rank = [r[label] for r in results]
        key = label.split(":")[0]
        worst[key] = max(worst.get(key, 0.0), per_rank[0]["sd_err"])
        try:
            check_parity(per_rank, f"{name} {label} at world {world}")
        except AssertionError as e:
            failures.append(str(e))
    print(f"\n{name} at world {world}: worst params rel err per optimizer, over its variants")
    for key, err in worst.items():
        print(f"  {key:28s} {err:.2e}")
    assert not failures, "\n".join(failures)


@pytest.mark.harness
def test_fused_variants_cover_torch():
    """FUSED is exactly the optimizers here whose CPU fused kernel steps (an empty parameter
    included); the others do not take ``fused`` at all."""
    for key, (cls, _) in OPTIMIZERS.items():
        takes_fused = "fused" in inspect.signature(cls).parameters
        assert takes_fused == (key in FUSED), (
            f"{key}: fused={takes_fused}, FUSED has it: {key in FUSED}"
        )
        if key in FUSED:
            params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(0))]
            for p in params:
                p.grad = torch.randn_like(p)
            opt = build_optimizer(key, "fused", [{"params": params, "weight_decay": 0.1}])
            opt.step()
