"""Variable-length (document-masked) attention over packed tokens.

``varlen_attention(q, k, v, cu_seqlens, max_seqlen)`` equals running
``F.scaled_dot_product_attention`` on every document ``q[cu[i]:cu[i+1]]`` alone and
concatenating the results: no token attends across a document boundary.

[Note: backends]
* CUDA, fp16/bf16, and torch ships ``torch.nn.attention.varlen.varlen_attn`` (2.10+): that
  flash kernel, fed ``cu_seqlens`` directly (cost ~ sum(len^2), no padding at all).
* Everywhere else (CPU, fp32, older torch): *length buckets*. Segments are grouped by length
  rounded up to 4 steps per octave (<= 25% padding per segment), each group is gathered into a
  padded ``[B, H, L, D]`` batch and run through one SDPA call. Cost grows with
  ``sum(len^2)`` (times at most 1.25^2), never with ``(sum len)^2``, and there is one SDPA call per
  bucket -- not per document -- so hundreds of short documents stay cheap. Causal attention needs
  no padding mask (a real query never sees the right-padding keys after it); bidirectional
  attention gets a key-padding mask. Outputs at padded positions are dropped before the scatter
  back, so autograd flows only through real tokens.
"""

from __future__ import annotations

import functools
import inspect
import itertools

import torch
import torch.nn.functional as F


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"varlen_attention expects q, k, v of shape [total_tokens, heads, head_dim], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}; flatten [rows, T] batches "
            f"with .flatten(0, 1) first"
        )
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(
            f"k and v must both be [{q.shape[0]}, kv_heads, {q.shape[2]}] to match q "
            f"{tuple(q.shape)}; got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"q has {q.shape[1]} heads, not a multiple of the {k.shape[1]} k/v heads; for "
            f"grouped-query attention use kv_heads dividing the query heads"
        )
    if cu.dim() != 1 or cu.numel() < 1 or cu.dtype.is_floating_point:
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor [num_docs + 1] of offsets starting at 0, "
            f"got shape {tuple(cu.shape)} dtype {cu.dtype}"
        )


def _segment_lengths(cu: torch.Tensor, total: int, max_seqlen: int) -> list[int]:
    """Validated per-segment lengths from ``cu_seqlens`` (host sync: one ``tolist``)."""
    offsets = cu.tolist()
    lengths = [b - a for a, b in itertools.pairwise(offsets)]
    if offsets[0] != 0 or offsets[-1] != total or any(n < 0 for n in lengths):
        raise ValueError(
            f"cu_seqlens must rise from 0 to total_tokens={total} without decreasing, got "
            f"{offsets[:4]}...{offsets[-2:]} (build it with flatshard.packing.collate)"
        )
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(
            f"max_seqlen={max_seqlen} is smaller than the longest segment ({max(lengths)}); "
            f"pass max_seqlen=int(cu_seqlens.diff().max())"
        )
    return lengths


def _bucket_length(n: int) -> int:
    """Round ``n`` up to 4 steps per power of two (exact below 8)."""
    step = 1 << max(0, n.bit_length() - 3)
    return -(-n // step) * step


@functools.lru_cache(maxsize=1)
def _flash_varlen_fn() -> tuple[object, frozenset[str]] | None:
    """torch's varlen flash kernel and its keyword names, or None when this torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _use_flash(q: torch.Tensor) -> bool:
    """The flash kernel takes CUDA fp16/bf16 with head_dim a multiple of 8 up to 256."""
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 256
        and _flash_varlen_fn() is not None
    )


def _flash_attention(q, k, v, cu, max_seqlen, causal, scale) -> torch.Tensor:
    fn, params = _flash_varlen_fn()
    kwargs: dict[str, object] = {}
    if scale is not None:
        if "scale" in params:
            kwargs["scale"] = scale
        else:  # the kernel divides by sqrt(head_dim): pre-scale q to get `scale` overall
            q = q * (scale * q.shape[-1] ** 0.5)
    if "window_size" in params:  # torch >= 2.11: causal is window (-1, 0)
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    else:  # torch 2.10: explicit flag
        kwargs["is_causal"] = causal
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    cu = cu.to(device=q.device, dtype=torch.int32)
    return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)


def _bucket_plan(lengths: list[int], device: torch.device):
    """Per length bucket ``(width, valid [B, L])``, plus the gather index of all padded rows and,
    for every token, its position in the concatenated padded buckets."""
    groups: dict[int, list[int]] = {}
    starts = [0]
    for s, n in enumerate(lengths):
        starts.append(starts[-1] + n)
        if n:
            groups.setdefault(_bucket_length(n), []).append(s)
    buckets, gather, source = [], [], torch.empty(starts[-1], dtype=torch.long, device=device)
    offset = 0
    for width, segs in sorted(groups.items()):
        seg_start = torch.tensor([starts[s] for s in segs], device=device)
        seg_len = torch.tensor([lengths[s] for s in segs], device=device)
        pos = torch.arange(width, device=device)
        valid = pos < seg_len[:, None]  # [B, L]
        idx = torch.where(valid, seg_start[:, None] + pos, seg_start[:, None])
        slot = offset + torch.arange(valid.numel(), device=device).view_as(valid)
        source[idx[valid]] = slot[valid]
        buckets.append((width, valid))
        gather.append(idx.flatten())
        offset += valid.numel()
    return buckets, gather, source


def _bucketed_attention(q, k, v, lengths, causal, scale) -> torch.Tensor:
    """Per-segment attention, one padded SDPA call per length bucket (see the module note).

    q, k and v are each gathered *once* into the concatenated padded buckets (so backward
    scatters into one zero tensor, not one per bucket), and the output is gathered back once.
    """
    buckets, gather, source = _bucket_plan(lengths, q.device)
    if not buckets:  # no tokens at all
        return q.new_zeros(q.shape)
    index = torch.cat(gather)
    sizes = [valid.numel() for _, valid in buckets]
    parts = [t[index].split(sizes) for t in (q, k, v)]
    gqa = k.shape[1] != q.shape[1]
    outs = []
    for (width, valid), qb, kb, vb in zip(buckets, *parts, strict=True):
        qb, kb, vb = (
            t.view(valid.shape[0], width, *t.shape[1:]).transpose(1, 2) for t in (qb, kb, vb)
        )
        mask = None if causal else valid[:, None, None, :]
        out = F.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
        )
        outs.append(out.transpose(1, 2).flatten(0, 1))  # [B * L, H, D]
    return torch.cat(outs)[source]


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention within each packed segment; ``[total, H, D]`` in, ``[total, H, D]`` out.

    Args:
        q: ``[total_tokens, heads, head_dim]``.
        k, v: ``[total_tokens, kv_heads, head_dim]``; ``kv_heads`` must divide ``heads``
            (grouped-query attention: query head ``h`` uses k/v head ``h // (heads // kv_heads)``).
        cu_seqlens: int ``[num_segments + 1]`` offsets, ``0 ... total_tokens`` (from
            :func:`flatshard.packing.collate`; padding tails are segments too).
        max_seqlen: longest segment (validated when ``cu_seqlens`` is on the CPU).
        causal: token ``i`` of a segment sees tokens ``<= i`` of that segment only.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.

    Differentiable in ``q``, ``k`` and ``v``. See the module note for the CUDA/CPU backends.
    """
    _check_shapes(q, k, v, cu_seqlens)
    use_flash = _use_flash(q)
    if use_flash:
        if cu_seqlens.device.type == "cpu":  # validating a device tensor would sync
            _segment_lengths(cu_seqlens, q.shape[0], max_seqlen)
        return _flash_attention(q, k, v, cu_seqlens, max_seqlen, causal, scale)
    lengths = _segment_lengths(cu_seqlens, q.shape[0], max_seqlen)
    return _bucketed_attention(q, k, v, lengths, causal, scale)


def document_attention_mask(
    cu_seqlens: torch.Tensor,
    total: int | None = None,
    *,
    causal: bool = True,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``[total, total]`` mask letting each token attend only within its own segment.

    With ``dtype=None`` a bool mask (True = may attend, the SDPA convention); with a float
    ``dtype`` an additive mask (0 where allowed, ``finfo(dtype).min`` elsewhere), which is what
    Hugging Face eager attention adds to its scores. For a Hugging Face model fed one packed row,
    pass ``attention_mask=document_attention_mask(cu, dtype=torch.float32)[None, None]``. It costs
    ``total^2`` memory: meant for tests and small inputs, not for training at length.
    """
    cu = cu_seqlens.to(torch.long)
    n = int(cu[-1]) if total is None else total
    lengths = _segment_lengths(cu.cpu(), n, max_seqlen=n)
    seg = torch.repeat_interleave(
        torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long)
    )
    allowed = seg[:, None] == seg[None, :]
    if causal:
        allowed &= torch.ones(n, n, dtype=torch.bool).tril()
    allowed = allowed.to(cu_seqlens.device)
    if dtype is None:
        return allowed
    return torch.zeros(n, n, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )
