"""Muon's whole-matrix math: the Newton–Schulz orthogonalisation and the shape-dependent LR.

The same operations, in the same order and dtype (bf16), as ``torch.optim.Muon`` in torch 2.9+,
so that a matrix gathered from its fragments gives bit for bit what torch computes on the
unsharded parameter (the cast to bf16 commutes with the gather, so fragments travel in bf16).
"""

from __future__ import annotations

import math

import torch

# Keller Jordan's quintic coefficients (https://kellerjordan.github.io/posts/muon/), as torch's.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
EPS = 1e-7
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def orthogonalize(
    matrix: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """``k = steps`` quintic Newton–Schulz iterations on ``matrix`` (2-D, any float dtype):
    about ``U V^T`` of its SVD ``U S V^T``, in bf16. The wide orientation is iterated (the Gram
    matrix is the smaller side squared)."""
    if steps >= 100:
        raise ValueError(f"ns_steps={steps}: Newton–Schulz takes fewer than 100 steps")
    if len(coefficients) != 3:
        raise ValueError(f"ns_coefficients={coefficients!r}: give exactly three (a, b, c)")
    a, b, c = coefficients
    tall = matrix.size(0) > matrix.size(1)
    x = matrix.bfloat16()
    x = x.T if tall else x
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2
        x = torch.addmm(x, poly, x, beta=a)  # a X + (b G + c G^2) X
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """The learning rate of a ``shape[0] x shape[1]`` matrix: Keller Jordan's
    ``sqrt(max(1, A/B))`` ("original", the default) or Moonshot's ``0.2 sqrt(max(A, B))``
    ("match_rms_adamw", which reuses AdamW's learning rate and weight decay)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def ns_cost(shape: torch.Size, steps: int) -> float:
    """Multiply-adds of ``orthogonalize`` on a matrix of ``shape`` (for balancing owners)."""
    small, large = sorted(shape[:2])
    return steps * (2.0 * small * small * large + small**3)
