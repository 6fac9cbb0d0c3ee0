"""Rotary position embeddings (RoPE), in the "rotate half" layout used by Llama and GPT-NeoX."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RotaryEmbedding", "apply_rotary", "positions_from_cu_seqlens"]


class RotaryEmbedding(nn.Module):
    """Holds cos/sin tables for positions ``0..max_seq_len-1`` and looks them up by position id.

    The tables are non-persistent fp32 buffers: they are not in the state dict (they are a pure
    function of the config), and after building on the meta device and ``to_empty()`` they hold
    garbage until :meth:`reset_parameters` recomputes them.
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        half = head_dim // 2
        self.register_buffer("cos", torch.empty(max_seq_len, half), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, half), persistent=False)
        if not self.cos.is_meta:
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re)compute the tables in fp32 on the buffers' device, e.g. after ``to_empty()``."""
        device = self.cos.device
        half = self.head_dim // 2
        inv_freq = self.theta ** (-torch.arange(half, device=device, dtype=torch.float64) / half)
        pos = torch.arange(self.max_seq_len, device=device, dtype=torch.float64)
        angles = torch.outer(pos, inv_freq)  # [S, D/2]; float64 so large positions stay exact
        self.cos = angles.cos().float()  # [S, D/2]
        self.sin = angles.sin().float()  # [S, D/2]

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for ``position_ids`` (any shape ``[...]``), each ``[..., 1, head_dim/2]``.

        The singleton dimension broadcasts over attention heads in ``[..., heads, head_dim]``.
        Positions must lie in ``[0, max_seq_len)``.
        """
        cos = self.cos[position_ids].unsqueeze(-2)  # [..., 1, D/2]
        sin = self.sin[position_ids].unsqueeze(-2)  # [..., 1, D/2]
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., heads, D]`` by the angles behind ``cos``/``sin [..., 1, D/2]``.

    Dimension ``i`` pairs with ``i + D/2`` ("rotate half"). Computed in ``x``'s dtype (Llama's
    choice) so that bf16 activations stay bf16.
    """
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)  # [..., H, D/2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # [..., H, D]


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of each of ``total`` packed tokens within its document: ``[total]`` int64.

    ``cu_seqlens`` are the document start offsets plus the end (``[0, l0, l0+l1, ..., total]``).
    Computed on the device without a host sync.
    """
    cu = cu_seqlens.to(torch.int64)
    idx = torch.arange(total, device=cu.device)  # [N]
    doc = torch.searchsorted(cu[1:], idx, right=True)  # [N] document of each token
    return idx - cu[doc]  # [N]
