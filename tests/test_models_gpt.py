"""The reference GPT: config, shapes, tying, packed attention, init, training, sampling."""

from __future__ import annotations

import itertools
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from flatshard.models import GPT, PRESETS, Block, GPTConfig, positions_from_cu_seqlens

torch.set_num_threads(1)

SMALL = GPTConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=64)
VARIANTS = [
    SMALL,
    GPTConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, mlp="gelu"),
    GPTConfig(d_model=32, n_layers=2, n_heads=2, max_seq_len=64, norm="layernorm", d_ff=48,
              tie_embeddings=False),
]  # fmt: skip


def _reference_varlen(q, k, v, cu_seqlens, max_seqlen, *, causal=True):
    """Slow, obviously-right varlen attention: SDPA on each document separately."""
    out = torch.empty_like(q)  # [N, H, D]
    bounds = cu_seqlens.tolist()
    for s, e in itertools.pairwise(bounds):
        qd, kd, vd = (t[s:e].transpose(0, 1) for t in (q, k, v))  # [H|KV, L, D]
        gqa = kd.shape[0] != qd.shape[0]
        y = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, enable_gqa=gqa)
        out[s:e] = y.transpose(0, 1)
    return out


def _packed_vs_alone(model: GPT, lengths: list[list[int]]) -> None:
    """Pack documents into rows of equal length; the packed forward must equal each doc alone."""
    torch.manual_seed(1)
    docs = [[torch.randint(0, 256, (n,)) for n in row] for row in lengths]
    ids = torch.stack([torch.cat(row) for row in docs])  # [B, T]
    flat_lengths = [n for row in lengths for n in row]
    cu = torch.tensor([0, *torch.tensor(flat_lengths).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in flat_lengths]).view(ids.shape)
    with torch.no_grad():
        packed = model(ids, position_ids=pos, cu_seqlens=cu, max_seqlen=max(flat_lengths))
        derived = model(ids, cu_seqlens=cu)  # positions and max_seqlen derived from cu_seqlens
        flat = model(ids.view(-1), position_ids=pos.view(-1), cu_seqlens=cu)  # [N] input
        alone = torch.cat([model(d.unsqueeze(0))[0] for row in docs for d in row])
    torch.testing.assert_close(packed.view(-1, packed.shape[-1]), alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(derived, packed, rtol=0, atol=0)
    torch.testing.assert_close(flat, packed.view(-1, packed.shape[-1]), rtol=1e-6, atol=1e-6)


# --- config --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"d_model": 30, "n_heads": 4}, ValueError, r"d_model=30 is not divisible by n_heads=4"),
        ({"d_model": 36, "n_heads": 4}, ValueError, r"head size d_model/n_heads=9 is odd"),
        ({"n_kv_heads": 3}, ValueError, r"n_kv_heads=3 does not divide n_heads=4"),
        ({"mlp": "relu"}, ValueError, r"mlp='relu' is not supported; use one of swiglu, gelu"),
        ({"norm": "batchnorm"}, ValueError, r"norm='batchnorm' is not supported"),
        ({"dropout": 1.0}, ValueError, r"dropout=1.0 is out of range"),
        ({"init_std": 0.0}, ValueError, r"init_std=0.0 is out of range"),
        ({"n_layers": 0}, ValueError, r"n_layers=0 must be positive"),
        ({"d_model": 32.0}, TypeError, r"d_model=32.0 must be an int"),
        ({"tie_embeddings": 1}, TypeError, r"tie_embeddings=1 must be True or False"),
    ],
)
def test_config_validation(overrides: dict, error: type, match: str) -> None:
    base = {"d_model": 32, "n_heads": 4}
    with pytest.raises(error, match=match):
        GPTConfig(**{**base, **overrides})


def test_presets_and_param_counts() -> None:
    assert list(PRESETS) == ["tiny", "small", "medium", "large", "1b"]
    assert 0.5e6 < PRESETS["tiny"].num_params() < 3e6
    assert 0.9e9 < PRESETS["1b"].num_params() < 1.1e9
    assert GPTConfig.preset("tiny", max_seq_len=128).max_seq_len == 128
    with pytest.raises(ValueError, match="unknown GPT preset 'huge'"):
        GPTConfig.preset("huge")
    for cfg in VARIANTS:
        model = GPT(cfg)
        assert model.num_params() == sum(p.numel() for p in model.parameters())
        body = sum(p.numel() for n, p in model.named_parameters() if "tok_emb" not in n)
        if not cfg.tie_embeddings:
            body -= model.lm_head.weight.numel()
        assert model.num_params(exclude_embeddings=True) == body
    cfg = PRESETS["tiny"]
    n = cfg.num_params(exclude_embeddings=True) + cfg.vocab_size * cfg.d_model
    assert cfg.flops_per_token(256) == 6 * n + 12 * cfg.n_layers * cfg.d_model * 256


# --- structure and forward -----------------------------------------------------------------


def test_forward_shapes_and_errors() -> None:
    model = GPT(SMALL)
    assert isinstance(model.layers[0], Block) and len(model.layers) == 2
    ids = torch.randint(0, 256, (3, 10))
    assert model(ids).shape == (3, 10, 258)
    assert model(ids[0]).shape == (10, 258)
    loss = model(ids, labels=ids)
    assert loss.shape == () and torch.isfinite(loss)
    with pytest.raises(ValueError, match="sequence length 65 exceeds max_seq_len=64"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="position_ids has shape"):
        model(ids, position_ids=torch.arange(7))


def test_tied_weights_are_one_parameter() -> None:
    tied = GPT(SMALL)
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert "lm_head.weight" not in dict(tied.named_parameters())
    assert "lm_head.weight" in tied.state_dict()
    untied = GPT(GPTConfig(d_model=32, n_heads=4, tie_embeddings=False))
    assert untied.lm_head.weight is not untied.tok_emb.weight


def test_positions_from_cu_seqlens() -> None:
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    assert positions_from_cu_seqlens(cu, 8).tolist() == [0, 1, 2, 0, 0, 1, 2, 3]


@pytest.mark.parametrize("cfg", VARIANTS, ids=["base", "gqa-gelu", "layernorm-untied"])
def test_packed_equals_alone_reference_varlen(cfg: GPTConfig, monkeypatch) -> None:
    """Model plumbing for packed batches, against a reference varlen attention."""
    fake = types.ModuleType("flatshard.packing")
    fake.varlen_attention = _reference_varlen
    monkeypatch.setitem(sys.modules, "flatshard.packing", fake)
    torch.manual_seed(0)
    _packed_vs_alone(GPT(cfg), [[5, 11, 4], [20]])


def test_packed_equals_alone_real_varlen() -> None:
    """Same, with flatshard.packing's varlen_attention."""
    torch.manual_seed(0)
    _packed_vs_alone(GPT(VARIANTS[1]), [[5, 11, 4], [1, 19]])


# --- initialisation ------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [SMALL, VARIANTS[2]], ids=["tied", "untied"])
def test_meta_init_matches_eager(cfg: GPTConfig) -> None:
    torch.manual_seed(123)
    eager = GPT(cfg)
    with torch.device("meta"):
        meta = GPT(cfg)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    torch.manual_seed(123)
    meta.reset_parameters()
    assert (meta.lm_head.weight is meta.tok_emb.weight) == cfg.tie_embeddings
    for (name, a), (_, b) in zip(
        eager.state_dict().items(), meta.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert torch.equal(meta.rope.cos, eager.rope.cos) and torch.equal(meta.rope.sin, eager.rope.sin)
    ids = torch.randint(0, 256, (2, 12))
    assert torch.equal(meta(ids), eager(ids))


def test_init_statistics() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(d_model=256, n_layers=8, n_heads=4)
    model = GPT(cfg)
    assert abs(model.tok_emb.weight.std().item() - 0.02) < 0.001
    out_std = model.layers[0].attn.o_proj.weight.std().item()
    assert abs(out_std - 0.02 / 4) < 0.0005  # scaled by 1/sqrt(2 * n_layers)
    assert torch.equal(model.layers[0].mlp_norm.weight, torch.ones(256))


# --- training and sampling -----------------------------------------------------------------


def test_a_few_steps_lower_the_loss() -> None:
    torch.manual_seed(0)
    model = GPT(SMALL)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    text = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 3))
    x, y = text[:-1].view(1, -1)[:, :64], text[1:].view(1, -1)[:, :64]
    losses = []
    for _ in range(8):
        loss = model(x, labels=y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_loss_sum_and_ignore_index() -> None:
    logits = torch.randn(2, 3, 5)
    labels = torch.tensor([[1, -100, 2], [0, 4, -100]])
    total = GPT.loss(logits, labels, reduction="sum")
    assert torch.allclose(GPT.loss(logits, labels), total / 4)


def test_generate() -> None:
    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    prompt = torch.tensor([104, 105])
    out = model.generate(prompt, max_new_tokens=5, temperature=0)
    assert out.shape == (7,) and torch.equal(out[:2], prompt)
    assert torch.equal(out, model.generate(prompt, max_new_tokens=5, temperature=0))
    gen = torch.Generator().manual_seed(0)
    batch = model.generate(prompt.repeat(2, 1), 70, temperature=0.8, top_k=5, generator=gen)
    assert batch.shape == (2, 72)  # longer than max_seq_len: the context is cropped
    first = int(out[2])
    stopped = model.generate(prompt, max_new_tokens=5, temperature=0, eos_id=first)
    assert stopped.tolist() == out[:3].tolist()
