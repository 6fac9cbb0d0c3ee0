"""Activation memory of the reference GPT, counted tensor by tensor (validated on CPU)."""

from __future__ import annotations

from dataclasses import dataclass

from flatshard.tools.estimate.spec import Layout, ModelSpec, Workload
from flatshard.tools.estimate.tp_cost import check_workload, local_spec, seq_shards

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
    block_selective: int
    """What a block keeps under torchtitan's per-op selective AC (``Workload.selective_ac``):
    its input, the outputs of wq, wv, w1 and w2 (every second matmul), attention's output and
    log-sum-exp, and with sequence parallelism the two reduce-scatters' outputs."""
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

    With ``layout.tp > 1`` (see [Note: the estimator's tensor parallelism]): ``spec``'s heads,
    ffn and vocabulary are one TP rank's share, and with sequence parallelism the residual
    stream and what a norm keeps besides its (all-gathered, whole) output are 1/tp.
    """
    spec = local_spec(spec, layout.tp)  # checks the model's sizes against tp first
    check_workload(layout, work)
    n, c, f, ab = work.tokens, spec.hidden, spec.ffn, layout.precision.act
    ns = n // seq_shards(layout)  # tokens of this rank's sequence shard (all without SP)
    composite = spec.norm == "rmsnorm" and not work.fused_norm
    inner = 2 * FP32 * c if composite else ab * c  # what a norm keeps besides its output
    norm32 = 2 if spec.norm == "layernorm" else 1  # (mean,) rstd per token, fp32
    norm = ns * (inner + FP32 * norm32) + n * ab * c  # bytes per norm, its output whole
    mlp = (4 if spec.mlp == "swiglu" else 2) * f
    attn = 2 * spec.q_width + 2 * spec.kv_width
    block = 2 * norm + n * (ab * (attn + mlp) + FP32 * spec.heads)
    if ab != FP32:  # apply_rotary casts cos/sin to the activations' dtype, for q and for k
        block += 2 * work.seq * spec.head_size * ab
    if work.attention == "math":  # the softmax probabilities, B x H x T x T
        block += ab * work.batch * spec.heads * work.seq * work.seq
    logits = n * spec.vocab * ab + (n * spec.vocab * FP32 if ab != FP32 else 0)  # + fp32 copy
    # torchtitan's op policy saves mm outputs 1, 3, 5, 7 of the block: wq, wv, w1, w2
    saved_mm = spec.q_width + spec.kv_width + f + c
    scattered = 2 * ns * c * ab if ns < n else 0  # reduce_scatter_tensor is on its save list
    selective = ns * c * ab + n * (ab * (saved_mm + spec.q_width) + FP32 * spec.heads) + scattered
    return Activations(
        block=block,
        block_input=ns * c * ab,
        block_selective=selective,
        head=norm + n * FP32 * spec.vocab,
        fixed=2 * n * INT64 + 2 * work.seq * (spec.head_size // 2) * FP32,
        mlp_workspace=n * ab * (c + (2 if spec.mlp == "swiglu" else 1) * f),
        grad_input=ns * c * ab,
        logits=logits,
        logits_grads=2 * n * spec.vocab * FP32,
    )
