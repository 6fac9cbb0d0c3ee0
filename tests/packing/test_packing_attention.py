"""varlen_attention equals per-document SDPA (forward and gradients), and is bucketed."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from flatshard.packing import attention as attention_module
from flatshard.packing import document_attention_mask, varlen_attention


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _reference(q, k, v, cu, causal, scale=None):
    """Each document alone through SDPA (k/v heads repeated for GQA)."""
    rep = q.shape[1] // k.shape[1]
    outs = []
    for a, b in itertools.pairwise(cu.tolist()):
        qd, kd, vd = (t[a:b].transpose(0, 1) for t in (q, k, v))
        kd, vd = kd.repeat_interleave(rep, 0), vd.repeat_interleave(rep, 0)
        outs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=scale))
    return torch.cat([o.transpose(0, 1) for o in outs])


def _grads(fn, q, k, v, grad_out):
    for t in (q, k, v):
        t.grad = None
    out = fn()
    (out * grad_out).sum().backward()
    return out.detach(), [t.grad.clone() for t in (q, k, v)]


LENGTHS = [5, 1, 17, 33, 8, 100, 3, 64, 9, 0, 2]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_matches_per_document_sdpa(causal, kv_heads):
    torch.manual_seed(0)
    cu, n = _cu(LENGTHS), sum(LENGTHS)
    q = torch.randn(n, 4, 16, requires_grad=True)
    k = torch.randn(n, kv_heads, 16, requires_grad=True)
    v = torch.randn(n, kv_heads, 16, requires_grad=True)
    grad_out = torch.randn(n, 4, 16)
    out, grads = _grads(
        lambda: varlen_attention(q, k, v, cu, max(LENGTHS), causal=causal), q, k, v, grad_out
    )
    ref, ref_grads = _grads(lambda: _reference(q, k, v, cu, causal), q, k, v, grad_out)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_scale_is_applied():
    torch.manual_seed(1)
    cu = _cu([7, 12])
    q, k, v = (torch.randn(19, 2, 8) for _ in range(3))
    out = varlen_attention(q, k, v, cu, 12, scale=0.3)
    torch.testing.assert_close(out, _reference(q, k, v, cu, True, scale=0.3))
    assert not torch.allclose(out, varlen_attention(q, k, v, cu, 12))


def test_equals_dense_sdpa_with_document_mask():
    torch.manual_seed(2)
    lengths = [4, 9, 3]
    cu, n = _cu(lengths), sum(lengths)
    q, k, v = (torch.randn(n, 2, 8) for _ in range(3))
    for causal in (True, False):
        mask = document_attention_mask(cu, causal=causal)
        dense = F.scaled_dot_product_attention(
            *(t.transpose(0, 1) for t in (q, k, v)), attn_mask=mask
        ).transpose(0, 1)
        torch.testing.assert_close(varlen_attention(q, k, v, cu, 9, causal=causal), dense)
        additive = document_attention_mask(cu, n, causal=causal, dtype=torch.float32)
        assert ((additive == 0) == mask).all()


def test_many_short_documents_use_few_sdpa_calls(monkeypatch):
    calls = []
    real_sdpa = F.scaled_dot_product_attention

    def counting_sdpa(*args, **kwargs):
        calls.append(args[0].shape)
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", counting_sdpa)
    lengths = torch.randint(1, 200, (400,), generator=torch.Generator().manual_seed(3)).tolist()
    cu, n = _cu(lengths), sum(lengths)
    q, k, v = (torch.randn(n, 2, 8) for _ in range(3))
    out = varlen_attention(q, k, v, cu, max(lengths))
    assert len(calls) <= 4 * 8 + 8, f"{len(calls)} SDPA calls for 400 documents"
    padded = sum(shape[0] * shape[2] for shape in calls)
    assert padded <= 1.25 * n, "at most 25% padding"
    head = sum(lengths[:3])  # the first documents do not notice the other 397
    small = varlen_attention(q[:head], k[:head], v[:head], _cu(lengths[:3]), 200)
    torch.testing.assert_close(out[:head], small, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("cu", "max_seqlen", "match"),
    [
        ([0, 3, 5], 5, "total_tokens=6"),
        ([1, 3, 6], 5, "rise from 0"),
        ([0, 4, 3, 6], 5, "without decreasing"),
        ([0, 3, 6], 2, "max_seqlen=2"),
    ],
)
def test_bad_cu_seqlens(cu, max_seqlen, match):
    q = torch.randn(6, 2, 4)
    with pytest.raises(ValueError, match=match):
        varlen_attention(q, q, q, torch.tensor(cu, dtype=torch.int32), max_seqlen)


def test_bad_shapes():
    q = torch.randn(6, 3, 4)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="not a multiple"):
        varlen_attention(q, torch.randn(6, 2, 4), torch.randn(6, 2, 4), cu, 6)
    with pytest.raises(ValueError, match="total_tokens, heads, head_dim"):
        varlen_attention(q[None], q[None], q[None], cu, 6)


def test_cpu_never_selects_the_cuda_kernel():
    assert not attention_module._use_flash(torch.randn(2, 1, 4, dtype=torch.bfloat16))


def _fake_kernel_new(
    q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), scale=None, enable_gqa=False
):
    """Stands in for torch>=2.11 varlen_attn (causal = window (-1, 0)) on the CPU."""
    assert cu_q is cu_k and cu_q.dtype == torch.int32
    assert enable_gqa == (k.shape[1] != q.shape[1])
    causal = tuple(window_size) == (-1, 0)
    return _reference(q, k, v, cu_q, causal, scale=scale)


def _fake_kernel_old(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False):
    """Stands in for torch 2.10 varlen_attn: no scale, no GQA."""
    assert k.shape[1] == q.shape[1], "GQA must have been expanded"
    return _reference(q, k, v, cu_q, is_causal)


@pytest.mark.parametrize("kernel", [_fake_kernel_new, _fake_kernel_old])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_kernel_plumbing(monkeypatch, kernel, causal):
    """The CUDA path's argument translation, checked on the CPU with stand-in kernels."""
    import inspect

    monkeypatch.setattr(attention_module, "_use_flash", lambda q: True)
    monkeypatch.setattr(
        attention_module,
        "_flash_varlen_fn",
        lambda: (kernel, frozenset(inspect.signature(kernel).parameters)),
    )
    torch.manual_seed(4)
    cu = _cu([6, 10, 3])
    q, k, v = torch.randn(19, 4, 8), torch.randn(19, 2, 8), torch.randn(19, 2, 8)
    out = varlen_attention(q, k, v, cu.long(), 10, causal=causal, scale=0.2)
    torch.testing.assert_close(out, _reference(q, k, v, cu, causal, scale=0.2))
