"""The reference GPT: a Llama-style decoder (RoPE, RMSNorm, SwiGLU) that understands packed batches.

Structure (``named_parameters`` names follow it)::

    GPT
      tok_emb   nn.Embedding(vocab_size, d_model)
      rope      RotaryEmbedding (non-persistent cos/sin buffers, no parameters)
      layers    nn.ModuleList[Block]   <- wrap these with an FSDP policy: fs.wrap.by_type(Block)
      norm      RMSNorm / LayerNorm
      lm_head   nn.Linear(d_model, vocab_size), weight *is* tok_emb.weight when tie_embeddings

Meta-device initialisation::

    with torch.device("meta"):
        model = GPT(config)            # no memory, no RNG use
    model.to_empty(device="cpu")       # or after sharding
    model.reset_parameters()           # same values as GPT(config) eagerly, from the same seed

``GPT(config)`` on a real device builds on meta internally too and then runs exactly those two
steps, so eager and meta-first construction draw the same random numbers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from flatshard.models.block import Block, make_norm
from flatshard.models.config import PRESETS, GPTConfig
from flatshard.models.rope import RotaryEmbedding, positions_from_cu_seqlens
from flatshard.models.sampling import generate as _generate

__all__ = ["GPT", "PRESETS", "Block", "Decoder", "GPTConfig"]


class Decoder(nn.Module):
    """What :class:`GPT` and ``MoEGPT`` share: the embedding, RoPE, a stack of ``n_layers``
    blocks made by ``make_block()``, the final norm and the (tied) head; meta-first init, the
    positions of padded and packed batches, and the loss. Subclasses choose the block and
    ``training_loss``."""

    def __init__(self, config: GPTConfig, make_block: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.config = config
        target = torch.empty(0).device  # the default device (possibly set by `with torch.device`)
        with torch.device("meta"):  # build without allocating or drawing random numbers
            # Given its weight, nn.Embedding skips its own init: normal_ on a meta tensor goes
            # through torch._refs and imports torch._dynamo (1-2 s in every process that builds
            # a GPT); reset_parameters() below draws the weight on the target device.
            weight = torch.empty(config.vocab_size, config.d_model)
            self.tok_emb = nn.Embedding(config.vocab_size, config.d_model, _weight=weight)
            self.rope = RotaryEmbedding(config.head_dim, config.max_seq_len, config.rope_theta)
            self.drop = nn.Dropout(config.dropout)
            self.layers = nn.ModuleList(make_block() for _ in range(config.n_layers))
            self.norm = make_norm(config)
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.tie_weights()
        if target.type != "meta":
            self.to_empty(device=target)
            self.reset_parameters()

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the very same Parameter as ``tok_emb.weight`` (if configured).

        ``to_empty()`` and similar conversions can replace the two with separate tensors; this
        restores the sharing and is a no-op when it is intact.
        """
        if self.config.tie_embeddings and self.lm_head.weight is not self.tok_emb.weight:
            self.lm_head.weight = self.tok_emb.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-initialise every parameter from the torch RNG and recompute the RoPE tables.

        Deterministic given the RNG state: embedding, then each block in order, then the final norm
        and (if untied) the head, all ``normal(0, init_std)`` except the residual output projections
        (``init_std / sqrt(2 * n_layers)``) and the norm weights (ones).
        """
        self.tie_weights()
        nn.init.normal_(self.tok_emb.weight, mean=0.0, std=self.config.init_std)
        for layer in self.layers:
            layer.reset_parameters()
        self.norm.reset_parameters()
        if not self.config.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, mean=0.0, std=self.config.init_std)
        self.init_buffers()

    def init_buffers(self) -> None:
        """Recompute the non-persistent RoPE tables (needed after ``to_empty()``)."""
        self.rope.reset_parameters()

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, T, V]`` for ``input_ids [B, T]`` (``[N, V]`` for ``[N]``), or the loss.

        Padded batches: leave ``cu_seqlens`` ``None``; attention is causal over each row and
        positions default to ``0..T-1``. Packed batches: ``cu_seqlens`` (int32 ``[docs + 1]``)
        holds the document offsets in the flattened ``B*T`` tokens; attention is causal within each
        document, ``position_ids`` (``[B, T]`` or ``[N]``) default to restarting at 0 per document,
        and ``max_seqlen`` (longest document) is computed if not given (a host sync).
        Positions must be below ``config.max_seq_len``.

        With ``labels`` (same shape as ``input_ids``, already shifted: ``labels[t]`` is the target
        after token ``t``; -100 = ignore) the mean cross-entropy is returned instead of the logits.
        """
        squeeze = input_ids.dim() == 1
        ids = input_ids.unsqueeze(0) if squeeze else input_ids  # [B, T]
        B, T = ids.shape
        pos = self._positions(B, T, ids.device, position_ids, cu_seqlens)  # [B|1, T]
        cos, sin = self.rope(pos)  # [B|1, T, 1, D/2] each
        if cu_seqlens is not None and max_seqlen is None:  # one host sync, not one per layer
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        x = self.drop(self.tok_emb(ids))  # [B, T, C]
        for layer in self.layers:
            x = layer(x, cos, sin, cu_seqlens, max_seqlen)  # [B, T, C]
        x = self.norm(x)  # [B, T, C]
        logits = self.lm_head(x)  # [B, T, V]
        if squeeze:
            logits = logits.squeeze(0)  # [N, V]
        if labels is not None:
            return self.training_loss(logits, labels)  # scalar
        return logits

    def training_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """What ``forward(..., labels=...)`` returns: the mean cross-entropy."""
        return self.loss(logits, labels)

    def _positions(
        self,
        B: int,
        T: int,
        device: torch.device,
        position_ids: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None,
    ) -> torch.Tensor:
        """Position ids shaped ``[B, T]`` or ``[1, T]`` (broadcast over the batch)."""
        if position_ids is not None:
            if position_ids.numel() != B * T and position_ids.shape[-1:] != (T,):
                raise ValueError(
                    f"position_ids has shape {tuple(position_ids.shape)}, but input_ids has "
                    f"{B}x{T} tokens; pass position_ids shaped like input_ids"
                )
            return position_ids.reshape(-1, T)  # [B|1, T]
        if cu_seqlens is not None:
            return positions_from_cu_seqlens(cu_seqlens, B * T).view(B, T)  # [B, T]
        if self.config.max_seq_len < T:
            raise ValueError(
                f"sequence length {T} exceeds max_seq_len={self.config.max_seq_len}; use shorter "
                "sequences or a config with a larger max_seq_len"
            )
        return torch.arange(T, device=device).unsqueeze(0)  # [1, T]

    @staticmethod
    def loss(
        logits: torch.Tensor,
        labels: torch.Tensor,
        *,
        ignore_index: int = -100,
        reduction: str = "mean",
    ) -> torch.Tensor:
        """Cross-entropy of ``logits [..., V]`` against ``labels [...]`` (computed in fp32).

        ``reduction="sum"`` gives the summed loss, for normalising over the global token count
        across ranks or micro-batches; ``"mean"`` averages over the non-ignored labels here.
        """
        flat = logits.reshape(-1, logits.shape[-1]).float()  # [N, V]
        try:
            return F.cross_entropy(
                flat, labels.reshape(-1), ignore_index=ignore_index, reduction=reduction
            )
        except RuntimeError as error:
            from torch.distributed.tensor import DTensor  # only a tensor-parallel model gets here

            if not isinstance(flat, DTensor):
                raise
            # Vocabulary-split logits (parallelize_gpt(loss_parallel=True)) need torch's
            # loss-parallel operators; outside the context DTensor only says "mixed tensors".
            raise ValueError(
                "the logits are split over the vocabulary (parallelize_gpt(..., "
                "loss_parallel=True)); compute the loss and run its backward inside "
                "`with torch.distributed.tensor.parallel.loss_parallel():`"
            ) from error


class GPT(Decoder):
    """Decoder-only transformer over token ids; see the module docstring for structure and init."""

    def __init__(self, config: GPTConfig) -> None:
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        super().__init__(config, lambda: Block(config))

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameter count (tied weights once); see :meth:`GPTConfig.num_params`."""
        return self.config.num_params(exclude_embeddings=exclude_embeddings)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token for MFU; see :meth:`GPTConfig.flops_per_token`."""
        return self.config.flops_per_token(seq_len)

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        *,
        eos_id: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample a continuation; see :func:`flatshard.models.sampling.generate`."""
        return _generate(
            self,
            input_ids,
            max_new_tokens,
            max_seq_len=self.config.max_seq_len,
            temperature=temperature,
            top_k=top_k,
            eos_id=eos_id,
            generator=generator,
        )
