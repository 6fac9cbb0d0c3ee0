"""Adding small updates to low-precision tensors without losing them.

bf16 keeps 8 significant bits: next to 1.0 its spacing is 2**-7 ≈ 0.0078, so ``1.0 + 1e-3``
rounds back to 1.0 — a thousand such updates leave the value at 1.0 (measured). Two remedies:

- **Kahan summation** (``kahan_add_``): a second low-precision tensor carries what rounding
  dropped and feeds it into the next addition; the sum is exact up to the compensation's own
  precision (a thousand 1e-3 steps reach 2.0).
- **Stochastic rounding** (``stochastic_round``): round up with probability equal to the
  dropped fraction, so the result is right *in expectation* (no extra memory, some noise).
"""

from __future__ import annotations

import torch

_LOW_HALF = -65536  # int32 0xFFFF0000: keeps the bits a bf16 holds


def stochastic_round(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16, up or down with probability proportional to the distance.

    bf16 is the top half of an fp32, so adding uniform noise to the low 16 bits of the bit
    pattern and truncating them rounds stochastically (sign-magnitude: truncation moves toward
    zero, the carry away from it, for either sign). inf/NaN round to nearest instead, so the
    carry cannot turn a NaN pattern into a number.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round expects an fp32 tensor, got {x.dtype}")
    noise = torch.randint(
        0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator
    )
    bits = x.view(torch.int32) + noise
    rounded = bits.bitwise_and_(_LOW_HALF).view(torch.float32).to(torch.bfloat16)
    return torch.where(x.isfinite(), rounded, x.to(torch.bfloat16))


@torch.no_grad()
def kahan_add_(param: torch.Tensor, compensation: torch.Tensor, update: torch.Tensor) -> None:
    """``param += update`` with Kahan compensation (``param``/``compensation`` low precision,
    ``update`` fp32 and consumed as scratch).

    The increment actually intended is ``update + compensation``; after rounding the new value
    to ``param``'s dtype, what was lost (intended minus applied) becomes the new compensation.
    Arithmetic is fp32, so the only error left is storing the (small) compensation.
    """
    old = param.float()  # a copy: param is low precision
    intended = update.add_(compensation.float())
    param.copy_(old + intended)
    compensation.copy_(intended.sub_(param.float().sub_(old)))
