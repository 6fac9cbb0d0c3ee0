"""Activation memory of the reference GPT, counted tensor by tensor (validated on CPU)."""

from __future__ import annotations

from dataclasses import dataclass

from .spec import Layout, ModelSpec, Workload

__all__ = ["Activations", "activations"]

INT64 = 8
FP32 = 4


@dataclass(frozen=True)
class Activations:
    """Bytes saved for backward (and the transients of backward) for one micro-batch."""

    block: int
    """One block without checkpointing."""
    block_input: int
    """The block's input, all a checkpointed block keeps."""
    head: int
    """Final norm, ``lm_head`` input and the fp32 log-softmax."""
    fixed: int
    """Token ids and labels (int64) and the RoPE cos/sin of this batch."""
    mlp_workspace: int
    """Extra bytes live in a block's MLP backward beyond its saved tensors."""
    grad_input: int
    """The gradient flowing between blocks."""
    logits: int
    """The logits (compute dtype), alive while the loss is computed."""
    logits_grads: int
    """Gradients of the log-softmax and of the logits during the loss backward."""


def activations(spec: ModelSpec, layout: Layout, work: Workload) -> Activations:
    """Saved-tensor bytes of the reference GPT block, counted tensor by tensor (see docs).

    Per token and block: each norm keeps its input and its output (compute dtype); PyTorch's
    composite RMSNorm (CPU) instead keeps the input upcast to fp32 and ``x * rstd`` in fp32, plus
    its output. Attention keeps q, k, v and its output; SwiGLU keeps gate, up, silu(gate) and
    their product (GELU: up and gelu(up)). fp32 extras: rstd (and the mean for LayerNorm) per
    norm, one log-sum-exp per head. ``math`` attention also keeps the T x T probabilities.
    """
    n, c, f, ab = work.tokens, spec.hidden, spec.ffn, layout.precision.act
    composite = spec.norm == "rmsnorm" and not work.fused_norm
    norm = (2 * FP32 + ab) * c if composite else 2 * ab * c  # bytes per token and norm
    norm32 = 2 if spec.norm == "layernorm" else 1  # (mean,) rstd per token, fp32
    mlp = (4 if spec.mlp == "swiglu" else 2) * f
    attn = 2 * c + 2 * spec.kv_width
    block = n * (2 * norm + ab * (attn + mlp) + FP32 * (spec.heads + 2 * norm32))
    head_dim = c // spec.heads
    if ab != FP32:  # apply_rotary casts cos/sin to the activations' dtype, for q and for k
        block += 2 * work.seq * head_dim * ab
    if work.attention == "math":  # the softmax probabilities, B x H x T x T
        block += ab * work.batch * spec.heads * work.seq * work.seq
    logits = n * spec.vocab * ab + (n * spec.vocab * FP32 if ab != FP32 else 0)  # + fp32 copy
    return Activations(
        block=block,
        block_input=n * c * ab,
        head=n * (norm + FP32 * norm32 + FP32 * spec.vocab),
        fixed=2 * n * INT64 + 2 * work.seq * (head_dim // 2) * FP32,
        mlp_workspace=n * ab * (c + (2 if spec.mlp == "swiglu" else 1) * f),
        grad_input=n * c * ab,
        logits=logits,
        logits_grads=2 * n * spec.vocab * FP32,
    )
