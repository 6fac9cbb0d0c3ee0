"""Hugging Face: packed rows (position_ids restarting at 0) give a tiny random Llama the same
per-document losses as each document alone.

transformers 5.x (checked on 5.24) builds a block-diagonal causal mask from restarting
``position_ids`` for *every* attention implementation, but only when ``attention_mask`` is None
and there is no KV cache -- hence ``use_cache=False``. ``document_attention_mask`` gives the
same result explicitly (for versions or models without that detection)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flatshard.packing import collate, document_attention_mask, packed_cross_entropy

transformers = pytest.importorskip("transformers")

VOCAB = 64


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation=request.param,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    assert model.config._attn_implementation == request.param
    return model


def _docs():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 3, 12, 1, 9)]


def _doc_losses(logits, batch, num_docs):
    token = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="none")
    doc_ids = batch.document_ids.flatten()
    return torch.stack([token[doc_ids == i].sum() for i in range(num_docs)])


def _alone(model, docs):
    losses = []
    for doc in docs:
        batch = collate([doc], len(doc), pad_id=0)
        logits = model(input_ids=batch.input_ids, use_cache=False).logits
        losses.append(_doc_losses(logits, batch, 1)[0])
    return torch.stack(losses)


def _packed_batch(docs):
    return collate(docs, sum(map(len, docs)) + 4, pad_id=0)  # one row, with a padding tail


@torch.no_grad()
def test_packed_position_ids_match_documents_alone(model):
    docs = _docs()
    batch = _packed_batch(docs)
    logits = model(
        input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False
    ).logits
    torch.testing.assert_close(_doc_losses(logits, batch, len(docs)), _alone(model, docs))


@torch.no_grad()
def test_explicit_document_mask_matches_documents_alone(model):
    docs = _docs()
    batch = _packed_batch(docs)
    mask = document_attention_mask(batch.cu_seqlens, dtype=torch.float32)[None, None]
    logits = model(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        attention_mask=mask,
        use_cache=False,
    ).logits
    torch.testing.assert_close(_doc_losses(logits, batch, len(docs)), _alone(model, docs))


@pytest.mark.harness
@torch.no_grad()
def test_negative_control_without_restarting_positions(model):
    docs = _docs()
    batch = _packed_batch(docs)
    positions = torch.arange(batch.input_ids.shape[1])[None]
    logits = model(input_ids=batch.input_ids, position_ids=positions, use_cache=False).logits
    leaky = _doc_losses(logits, batch, len(docs))
    assert not torch.allclose(leaky[1:], _alone(model, docs)[1:], rtol=1e-3, atol=1e-3)


@torch.no_grad()
def test_hf_loss_with_shift_labels_equals_packed_cross_entropy(model):
    batch = _packed_batch(_docs())
    out = model(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        labels=batch.labels,
        shift_labels=batch.labels,  # already shifted: HF must not shift again
        use_cache=False,
    )
    ours = packed_cross_entropy(out.logits, batch.labels, batch.num_targets, world_size=1)
    torch.testing.assert_close(out.loss, ours)
