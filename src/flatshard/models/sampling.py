"""Autoregressive sampling for a short text sample (no KV cache: each step reruns the context)."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["generate"]


@torch.no_grad()
def generate(
    model: Callable[[torch.Tensor], torch.Tensor],
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    max_seq_len: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Append up to ``max_new_tokens`` sampled ids to ``input_ids`` (``[B, T]`` or ``[T]``).

    ``model`` maps ``[B, T]`` ids to ``[B, T, V]`` logits. The context is cropped to the last
    ``max_seq_len`` ids. ``temperature=0`` is greedy; ``top_k`` keeps the k likeliest ids. Stops
    early once every row has produced ``eos_id`` (rows that finished keep sampling; cut at the eos).
    Returns the same rank as ``input_ids``.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if top_k is not None and top_k <= 0:
        raise ValueError(f"top_k={top_k} must be positive, or None to sample from all ids")
    squeeze = input_ids.dim() == 1
    ids = input_ids.unsqueeze(0) if squeeze else input_ids  # [B, T]
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)  # [B]
    for _ in range(max_new_tokens):
        logits = model(ids[:, -max_seq_len:])[:, -1, :].float()  # [B, V]
        nxt = _sample(logits, temperature, top_k, generator)  # [B, 1]
        ids = torch.cat((ids, nxt), dim=1)  # [B, T+1]
        if eos_id is not None:
            done |= nxt.squeeze(1) == eos_id  # [B]
            if bool(done.all()):
                break
    return ids.squeeze(0) if squeeze else ids


def _sample(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> torch.Tensor:
    """One id per row of ``logits [B, V]``: ``[B, 1]``."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)  # [B, 1]
    logits = logits / temperature  # [B, V]
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))  # [B, V]
    probs = torch.softmax(logits, dim=-1)  # [B, V]
    return torch.multinomial(probs, num_samples=1, generator=generator)  # [B, 1]
