"""The Mixture-of-Experts model and its expert parallelism (groundwork for issue 28, goal 2).

Single process: routing, the load-balancing loss, the grouped expert computation against a
per-token loop, initialisation of expert slices. Gloo pools (cases in ``moe_cases.py``): at world
2 (ep 2) and world 4 (ep 2 x dp 2, and ep 4), the EP model's loss, gradients (every step) and
parameters after 2 SGD steps equal one process holding every expert, with uneven splits and
experts that get no tokens from some rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flatshard as fs
from flatshard.models.config import GPTConfig
from flatshard.models.moe import (
    Experts,
    MoEBlock,
    MoEConfig,
    MoEGPT,
    MoELayer,
    load_balancing_loss,
    shard_experts,
)
from moe_cases import case_parity, case_ready, merge

TINY = MoEConfig.preset("tiny")
TOLERANCE = 1e-6
WHAT = ("grads", "params")  # every step's gradients; the parameters after the 2 steps
SPECS = {
    2: [
        dict(ep=2, dp=1, group="process_group", build="construct"),
        dict(ep=2, dp=1, group="process_group", build="shard_experts"),
    ],
    4: [
        dict(ep=2, dp=2, group="mesh", build="construct"),
        dict(ep=4, dp=1, group="mesh", build="shard_experts"),
    ],
}


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (dict(top_k=5), "top_k=5 exceeds n_experts=4"),
        (dict(n_experts=0), "n_experts=0 must be a positive int"),
        (dict(aux_loss_coef=-1.0), "aux_loss_coef=-1.0"),
        (dict(n_heads=3), "not divisible by n_heads"),  # GPTConfig's checks still run
    ],
)
def test_config_rejects_bad_values(overrides, error):
    with pytest.raises(ValueError, match=error):
        MoEConfig.preset("tiny", **overrides)


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_num_params_counts_every_parameter(mlp):
    config = MoEConfig.preset("tiny", mlp=mlp)
    model = MoEGPT(config)
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    expert = model.layers[0].moe.experts
    per_expert = sum(p[0].numel() for p in expert.parameters())
    idle = config.n_layers * (config.n_experts - config.top_k) * per_expert
    assert config.num_params(active=True) == config.num_params() - idle


def test_router_keeps_top_k_and_renormalises():
    torch.manual_seed(0)
    router = MoELayer(TINY).router
    x = torch.randn(10, TINY.d_model)
    weights, ids = router(x)
    probs = F.softmax(router.gate(x), dim=-1)
    top, expected_ids = probs.topk(TINY.top_k, dim=-1)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True))
    torch.testing.assert_close(weights.sum(-1), torch.ones(10))


def test_load_balancing_loss():
    ids = torch.tensor([[0, 1], [0, 2], [0, 1]])  # shares 3/6, 2/6, 1/6, 0
    uniform = torch.full((3, 4), 0.25)
    assert load_balancing_loss(uniform, ids).item() == pytest.approx(1.0)
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.1]] * 3)
    expected = 4 * (3 / 6 * 0.5 + 2 / 6 * 0.3 + 1 / 6 * 0.1)
    assert load_balancing_loss(probs, ids).item() == pytest.approx(expected)
    model = MoEGPT(TINY)
    ids = torch.randint(0, TINY.vocab_size, (2, 8))
    ce = model.loss(model(ids), ids)
    total = model(ids, labels=ids)
    torch.testing.assert_close(total, ce + TINY.aux_loss_coef * model.aux_loss)


def _per_token_reference(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """``sum_k weight_k * expert_k(token)``, token by token, from the stacked weights."""
    experts = layer.experts
    weights, ids = layer.router(x)
    rows = []
    for token, token_weights, token_ids in zip(x, weights, ids, strict=True):
        y = torch.zeros_like(token)
        for w, e in zip(token_weights, token_ids.tolist(), strict=True):
            h = token @ experts.w1[e]
            h = (
                F.gelu(h, approximate="tanh")
                if experts.w3 is None
                else F.silu(h) * (token @ experts.w3[e])
            )
            y = y + w * (h @ experts.w2[e])
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_grouped_experts_equal_a_per_token_loop(mlp):
    torch.manual_seed(0)
    layer = MoEGPT(MoEConfig.preset("tiny", mlp=mlp)).layers[0].moe
    x = torch.randn(1, 12, TINY.d_model)
    got, want = layer(x).view(12, -1), _per_token_reference(layer, x.view(12, -1))
    torch.testing.assert_close(got, want)
    params = list(layer.parameters())
    got_grads = torch.autograd.grad(got.square().sum(), params)
    want_grads = torch.autograd.grad(want.square().sum(), params)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)


def test_an_expert_without_tokens_gets_a_zero_gradient():
    torch.manual_seed(0)
    experts = Experts(4, 8, 16)
    experts.reset_parameters(0.02, 0.01)
    experts(torch.randn(5, 8), [3, 0, 2, 0]).sum().backward()
    assert experts.w1.grad is not None and experts.w1.grad[[1, 3]].abs().sum() == 0
    assert experts.w1.grad[[0, 2]].abs().sum() > 0


def test_a_slice_of_experts_draws_the_full_modules_numbers():
    full, part = Experts(4, 8, 16), Experts(4, 8, 16, first=2, n_local=2)
    for module in (full, part):
        torch.manual_seed(0)
        module.reset_parameters(0.02, 0.01)
    for name in ("w1", "w2", "w3"):
        assert torch.equal(getattr(part, name), getattr(full, name)[2:4])


def test_meta_init_equals_eager_and_a_policy_finds_the_experts():
    torch.manual_seed(0)
    eager = MoEGPT(TINY)
    with torch.device("meta"):
        lazy = MoEGPT(TINY)
    lazy.to_empty(device="cpu")
    torch.manual_seed(0)
    lazy.reset_parameters()
    for (name, a), b in zip(eager.state_dict().items(), lazy.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert lazy.lm_head.weight is lazy.tok_emb.weight
    picked = [m for m in eager.modules() if fs.wrap.by_type(Experts, MoEBlock)(m)]
    assert len(picked) == 2 * TINY.n_layers


def test_the_model_learns():
    torch.manual_seed(0)
    model = MoEGPT(TINY)
    ids = torch.randint(0, TINY.vocab_size, (4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = model(ids[:, :-1], labels=ids[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_packed_documents_equal_separate_rows():
    torch.manual_seed(0)
    model = MoEGPT(TINY)
    docs = torch.randint(0, TINY.vocab_size, (2, 6))
    cu_seqlens = torch.tensor([0, 6, 12], dtype=torch.int32)
    packed = model(docs.reshape(1, 12), cu_seqlens=cu_seqlens)  # [1, 12, V]
    torch.testing.assert_close(packed.view(2, 6, -1), model(docs))


def test_user_mistakes_are_named():
    with pytest.raises(ValueError, match="has no MoELayer"):
        shard_experts(torch.nn.Linear(2, 2), object())
    with pytest.raises(TypeError, match="ProcessGroup or a 1-D DeviceMesh"):
        MoEGPT(TINY, ep_group="ep")
    with pytest.raises(TypeError, match="must be a MoEConfig"):
        MoEGPT(GPTConfig())


@pytest.fixture(scope="module")
def parity(dist_pools):
    """``parity(world)`` -> merged result per spec of ``SPECS[world]`` (one pool job each)."""
    cache: dict = {}

    def get(world: int) -> list[dict]:
        if world not in cache:
            pool = dist_pools(world)
            pool.run(case_ready)
            try:
                outs = pool.run(case_parity, SPECS[world], timeout=120)
                cache[world] = [merge([o[i] for o in outs]) for i in range(len(SPECS[world]))]
            except (AssertionError, TimeoutError) as exc:
                cache[world] = exc  # cached: the other tests of this world do not rerun it
        if isinstance(cache[world], Exception):
            raise AssertionError(f"the world-{world} EP job failed") from cache[world]
        return cache[world]

    return get


CASES = [(w, i) for w, specs in SPECS.items() for i in range(len(specs))]
IDS = ["world{}-ep{ep}xdp{dp}-{group}-{build}".format(w, **SPECS[w][i]) for w, i in CASES]


@pytest.mark.parametrize(("world", "index"), CASES, ids=IDS)
def test_expert_parallel_equals_one_process(parity, world, index):
    r = parity(world)[index]
    assert r["init"] == 0.0, "the EP model starts from the full model's slice"
    assert r["loss"] <= TOLERANCE, r
    for key in [f"{what}_{kind}" for what in WHAT for kind in ("dense", "expert")]:
        err, name = r[key]
        assert err <= TOLERANCE, f"{key}: {err:.2e} at {name}"


@pytest.mark.parametrize("world", SPECS)
def test_splits_are_uneven_and_some_expert_gets_no_tokens(parity, world):
    routing = parity(world)[0]["routing"]  # [rank][layer][expert]: assignments routed
    assert any(0 in layer for rank in routing for layer in rank), routing
    assert any(len(set(layer)) > 1 for rank in routing for layer in rank), routing
