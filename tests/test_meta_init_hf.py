"""A transformers model built on the meta device initialises through its own ``_init_weights``
when ``fs.shard`` materialises it (no ``init_fn``): the same distribution per tensor as the
model built in full (norms exactly one, rotary tables exact, GPT-2's scaled projections)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


def _models():
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    qwen = Qwen2Config(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    gpt2 = GPT2Config(vocab_size=300, n_embd=32, n_layer=3, n_head=2, n_positions=64)
    return [(Qwen2ForCausalLM, qwen), (GPT2LMHeadModel, gpt2)]


def case_meta_init_matches_full_init() -> dict:
    import torch

    import flatshard as fs
    from flatshard.integrations.transformers import no_split_policy

    out = {}
    for cls, config in _models():
        torch.manual_seed(0)
        reference = cls(config).state_dict()
        with torch.device("meta"):
            model = cls(config)
        fs.shard(model, policy=no_split_policy(model))
        full = fs.full_state_dict(model)
        if not full:  # rank 1: the shards only; rank 0 holds the full copy
            continue
        worst = {}
        for key, ref in reference.items():
            got = full[key].float()
            ref = ref.float()
            worst[key] = (
                abs(got.mean().item() - ref.mean().item()),
                abs(got.std().item() - ref.std().item()) / max(ref.std().item(), 1e-3),
                bool(torch.isfinite(got).all()),
            )
        out[cls.__name__] = worst
    return out


def test_meta_built_transformers_models_init_like_full_ones(dist_pools):
    results = dist_pools(2).run(case_meta_init_matches_full_init)[0]
    assert set(results) == {"Qwen2ForCausalLM", "GPT2LMHeadModel"}
    for name, worst in results.items():
        for key, (mean_err, std_rel_err, finite) in worst.items():
            assert finite, (name, key)
            assert mean_err < 0.01 and std_rel_err < 0.2, (name, key, mean_err, std_rel_err)
