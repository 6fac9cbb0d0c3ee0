"""No cross-contamination: a packed batch gives each document the loss and the gradient it gets
when run alone. A small transformer (GQA attention via varlen_attention, learned positions via
position_ids) is defined here so that the test depends on nothing but flatshard.packing."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from flatshard.packing import collate, pack, varlen_attention

VOCAB, DIM, HEADS, KV_HEADS, SEQ = 40, 32, 4, 2, 48


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q = nn.Linear(DIM, DIM)
        self.kv = nn.Linear(DIM, 2 * KV_HEADS * self.head_dim)
        self.proj = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x, cu_seqlens, max_seqlen, attend):
        h = self.ln1(x)  # x: [N, DIM]
        q = self.q(h).view(-1, HEADS, self.head_dim)
        k, v = self.kv(h).view(-1, 2, KV_HEADS, self.head_dim).unbind(1)
        a = attend(q, k, v, cu_seqlens, max_seqlen).reshape(-1, DIM)
        x = x + self.proj(a)
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, position_ids, cu_seqlens, max_seqlen, attend=varlen_attention):
        x = self.tok(input_ids.flatten()) + self.pos(position_ids.flatten())
        for block in self.blocks:
            x = block(x, cu_seqlens, max_seqlen, attend)
        return self.head(self.ln(x))  # [N, VOCAB]


def _doc_losses(model, batch, num_docs, **kwargs):
    logits = model(
        batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen, **kwargs
    )
    token_loss = F.cross_entropy(logits, batch.labels.flatten(), reduction="none")
    doc_ids = batch.document_ids.flatten()
    return torch.stack([token_loss[doc_ids == i].sum() for i in range(num_docs)])


def _docs():
    g = torch.Generator().manual_seed(0)
    lengths = [3, 17, 2, 30, 9, 1, 12, 25, 6, 40, 5]
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _alone(model, docs):
    """Loss sums and gradient of each document run on its own (batch of one, no packing)."""
    model.zero_grad()
    losses = []
    for doc in docs:
        loss = _doc_losses(model, collate([doc], len(doc), pad_id=0), 1)[0]
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses), {n: p.grad.clone() for n, p in model.named_parameters()}


def _packed(model, docs):
    model.zero_grad()
    bins = pack([len(d) for d in docs], SEQ)
    order = [i for b in bins for i in b]
    batch = collate([docs[i] for i in order], SEQ, pad_id=0, rows=len(bins))
    losses = _doc_losses(model, batch, len(order))
    losses.sum().backward()
    back = torch.empty_like(losses)
    back[torch.tensor(order)] = losses.detach()
    return back, {n: p.grad.clone() for n, p in model.named_parameters()}, batch


def test_packed_losses_and_gradients_equal_documents_alone():
    torch.manual_seed(0)
    model = TinyLM()
    docs = _docs()
    alone_loss, alone_grad = _alone(model, docs)
    packed_loss, packed_grad, batch = _packed(model, docs)
    assert batch.input_ids.shape[0] < len(docs), "several documents share a row"
    torch.testing.assert_close(packed_loss, alone_loss, rtol=1e-5, atol=1e-5)
    for name, grad in alone_grad.items():
        torch.testing.assert_close(packed_grad[name], grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.harness
def test_negative_control_plain_causal_attention_contaminates():
    """Without the document mask (one causal sequence per row) the same check must fail."""
    torch.manual_seed(0)
    model = TinyLM()
    docs = _docs()
    alone_loss, _ = _alone(model, docs)
    _, _, batch = _packed(model, docs)
    rows, seq = batch.input_ids.shape
    row_cu = torch.arange(0, rows * seq + 1, seq, dtype=torch.int32)
    leaky = _doc_losses(
        model,
        batch,
        len(docs),
        attend=lambda q, k, v, cu, m: varlen_attention(q, k, v, row_cu, seq),
    )
    order = [i for b in pack([len(d) for d in docs], SEQ) for i in b]
    assert not torch.allclose(leaky, alone_loss[torch.tensor(order)], rtol=1e-3, atol=1e-3)
