"""Loss normalisation over global target tokens, with rank-averaged gradients.

The simulated tests run several "ranks" and micro-batches in one process and average their
gradients the way flatshard's reduce-scatter does; one test runs a real Gloo group."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from flatshard.packing import collate, global_token_count, packed_cross_entropy

VOCAB = 30


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 16), nn.Tanh(), nn.Linear(16, VOCAB))


def _global_batch(world: int, micro: int, seed: int = 0):
    """batches[rank][micro]: packed micro-batches with very different numbers of targets."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(world):
        per_rank = []
        for _ in range(micro):
            n_docs = int(torch.randint(1, 6, (1,), generator=g))
            lengths = torch.randint(2, 12, (n_docs,), generator=g).tolist()
            docs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
            per_rank.append(collate(docs, 64, pad_id=0))
        batches.append(per_rank)
    return batches


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _reference(model, batches):
    """Plain mean token loss over the whole global batch, and its gradient."""
    model.zero_grad()
    ids = torch.cat([b.input_ids.flatten() for rank in batches for b in rank])
    labels = torch.cat([b.labels.flatten() for rank in batches for b in rank])
    loss = F.cross_entropy(model(ids), labels, ignore_index=-100)
    loss.backward()
    return loss.detach(), _grads(model)


def _simulated_ranks(model, batches, per_micro_batch_mean: bool = False):
    """Every rank accumulates over its micro-batches; gradients are then averaged over ranks."""
    world = len(batches)
    global_tokens = sum(global_token_count([b.labels for b in rank]) for rank in batches)
    rank_grads, rank_losses = [], []
    for rank in batches:
        model.zero_grad()
        total = 0.0
        for b in rank:
            logits = model(b.input_ids)
            if per_micro_batch_mean:  # the naive normalisation, for the negative control
                loss = F.cross_entropy(logits.flatten(0, 1), b.labels.flatten()) / len(rank)
            else:
                loss = packed_cross_entropy(logits, b.labels, global_tokens, world_size=world)
            loss.backward()
            total += loss.item()
        rank_grads.append(_grads(model))
        rank_losses.append(total)
    averaged = [torch.stack(gs).mean(0) for gs in zip(*rank_grads, strict=True)]
    return sum(rank_losses) / world, averaged


@pytest.mark.parametrize(("world", "micro"), [(1, 3), (2, 2), (3, 4)])
def test_rank_averaged_gradient_equals_global_mean(world, micro):
    model = _model()
    batches = _global_batch(world, micro)
    ref_loss, ref_grads = _reference(model, batches)
    loss, grads = _simulated_ranks(model, batches)
    assert loss == pytest.approx(ref_loss.item(), rel=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.harness
def test_negative_control_per_micro_batch_mean_is_biased():
    model = _model()
    batches = _global_batch(3, 4)
    _, ref_grads = _reference(model, batches)
    _, naive = _simulated_ranks(model, batches, per_micro_batch_mean=True)
    assert not all(
        torch.allclose(g, r, rtol=1e-3, atol=1e-5) for g, r in zip(naive, ref_grads, strict=True)
    )


def test_world_size_factor_scales_the_loss():
    logits = torch.randn(2, 5, VOCAB)
    labels = torch.randint(0, VOCAB, (2, 5))
    labels[0, :2] = -100
    one = packed_cross_entropy(logits, labels, 8, world_size=1)
    assert packed_cross_entropy(logits, labels, 8, world_size=3) == pytest.approx(3 * one.item())
    total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    assert one.item() == pytest.approx(total.item() / 8)


def test_local_counts_without_process_group():
    labels = torch.tensor([[1, -100, 2], [-100, -100, 3]])
    assert global_token_count(labels) == 3
    assert global_token_count([labels, labels[:1]]) == 5
    assert global_token_count(7) == 7


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"global_tokens": 0, "world_size": 2}, "global_tokens=0"),
        ({"global_tokens": 4, "world_size": 0}, "world_size=0"),
    ],
)
def test_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        packed_cross_entropy(torch.randn(3, VOCAB), torch.tensor([1, 2, 3]), **kwargs)


def gloo_training_step() -> tuple[int, float]:
    """On every rank of a Gloo group: count globally, accumulate, average gradients like the
    engine, and compare with the single-process gradient of the global mean."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    batches = _global_batch(world, 3, seed=5)
    _, ref_grads = _reference(model, batches)
    mine = batches[rank]
    global_tokens = global_token_count([b.labels for b in mine])
    model.zero_grad()
    for b in mine:
        packed_cross_entropy(
            model(b.input_ids), b.labels, global_tokens, world_size=world
        ).backward()
    err = 0.0
    for p, ref in zip(model.parameters(), ref_grads, strict=True):
        dist.all_reduce(p.grad)
        p.grad /= world
        err = max(err, (p.grad - ref).abs().max().item())
    return global_tokens, err


def test_gloo_global_count_and_gradient(dist_pools):
    pool = dist_pools(2)
    results = pool.run(gloo_training_step)
    expected = sum(b.num_targets for rank in _global_batch(2, 3, seed=5) for b in rank)
    assert [count for count, _ in results] == [expected, expected]
    assert max(err for _, err in results) < 1e-6
