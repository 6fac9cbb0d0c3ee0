"""Cutting flatshard's GPT into pipeline stages that keep the whole model's parameter names.

[Note: whole-model names on every stage]
A stage is the GPT with the blocks of other stages left out (torchtitan's way): it holds
``tok_emb`` on the first stage, ``layers`` as an ``nn.ModuleDict`` keyed by the *global* block
index (``layers.3.attn.wq.weight`` stays ``layers.3.attn.wq.weight``), and ``norm`` + ``lm_head``
on the last. So a stage's ``named_parameters()`` / ``state_dict()`` keys are a subset of the
unsharded GPT's, and one checkpoint of all stages reads back at any pp (or none). The RoPE
tables (buffers, no parameters) are copied into every stage.

Packed rows cross the pipeline as ``input_ids`` (first stage) or hidden states, plus
``position_ids`` passed to every stage as a keyword (torch's schedules split keyword
arguments into microbatches and hand them to each stage). Each stage derives the documents'
``cu_seqlens`` from the positions of its microbatch (a position 0 starts every document and
every padding segment, see ``flatshard.packing.collate``), so attention never crosses a
document boundary, as in the unpipelined trainer.

Tied embeddings: the first stage holds ``tok_emb.weight``, the last a copy of it as
``lm_head.weight`` (equal values); ``build_pipeline`` declares the pair with
``fs.tie_across_stages``, which sums their gradients every step (both names are in the
checkpoint; a tied unpipelined model reads ``tok_emb.weight`` and treats the other as its
alias).

MoE stages (``model.experts``): the same cut of ``MoEGPT`` (same attribute names). The
routers' load-balancing loss never reaches the schedule's ``loss_fn``, which sees the logits
only: each stage adds its own routers' share, ``aux_scale`` times their summed loss, to the
gradient by :class:`_WithAuxGrad` on its output (identity forward; backward also sends
gradient 1 into that share), as the unpipelined trainer's ``loss + aux`` does.

The split of blocks: ``n_layers`` over ``n_stages`` as evenly as possible, the first stages
taking one more when it does not divide (the first and last also hold the embedding and head).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from flatshard.models import GPT

__all__ = ["GPTStage", "cu_seqlens_from_positions", "layer_split"]


class _WithAuxGrad(torch.autograd.Function):
    """``x`` unchanged; its backward also backpropagates gradient 1 into ``aux`` (a scalar
    loss computed inside the stage), so it joins the step's gradient (Megatron's trick)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_like = (aux.shape, aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.aux_like
        return grad, torch.ones(shape, dtype=dtype, device=device)


def layer_split(n_layers: int, n_stages: int) -> list[range]:
    """The global block indices of each stage (contiguous, as even as possible)."""
    if n_stages > n_layers:
        raise ValueError(
            f"{n_stages} pipeline stages need at least {n_stages} blocks, the model has "
            f"n_layers={n_layers}: pass a --model.n_layers of at least {n_stages}, or fewer "
            "stages (--parallelism.pp, --parallelism.stages_per_rank)"
        )
    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for stage in range(n_stages):
        size = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def cu_seqlens_from_positions(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``cu_seqlens`` (int32 ``[segments + 1]``) and the longest segment of packed rows whose
    ``position_ids [B, T]`` restart at 0 at every document (and every row start)."""
    flat = position_ids.reshape(-1)  # [B*T]
    starts = torch.nonzero(flat == 0).flatten()  # [segments]
    end = torch.tensor([flat.numel()], device=flat.device)
    cu = torch.cat([starts, end]).to(torch.int32)  # [segments + 1]
    return cu, int((cu[1:] - cu[:-1]).max())  # one host sync per stage and microbatch


class GPTStage(nn.Module):
    """Blocks ``layers`` of ``model`` (taken, not copied), with its embedding when ``first``
    and its final norm and head when ``last``; see [Note: whole-model names on every stage]."""

    def __init__(self, model: GPT, layers: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.config = model.config
        self.tok_emb = model.tok_emb if first else None
        self.rope = copy.deepcopy(model.rope)  # buffers only: every stage needs the tables
        self.drop = copy.deepcopy(model.drop)
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        self.aux_scale = 0.0  # MoE: the weight of this stage's routers' loss (set by the builder)
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        if last and not first and model.config.tie_embeddings:
            # the head's own copy of the tied matrix (equal values): the first stage holds the
            # embedding; fs.tie_across_stages keeps the two one parameter while training
            self.lm_head = copy.deepcopy(model.lm_head)

    @property
    def width(self) -> int:
        """The hidden width a stage sends on (as ``HFStage.width``, pipeline_hf)."""
        return self.config.d_model

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """``x``: ids ``[B, T]`` (first stage) or hidden ``[B, T, C]``; returns hidden
        ``[B, T, C]``, or logits ``[B, T, V]`` on the last stage."""
        cos, sin = self.rope(position_ids)  # [B, T, 1, D/2] each
        cu_seqlens, max_seqlen = cu_seqlens_from_positions(position_ids)
        if self.tok_emb is not None:
            x = self.drop(self.tok_emb(x))  # [B, T, C]
        for layer in self.layers.values():
            x = layer(x, cos, sin, cu_seqlens, max_seqlen)  # [B, T, C]
        if self.aux_scale and torch.is_grad_enabled():
            aux = sum(layer.moe.router.aux_loss for layer in self.layers.values())
            x = _WithAuxGrad.apply(x, self.aux_scale * aux)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))  # [B, T, V]
        return x
