"""Blockwise absmax quantization of gradient chunks for ``fs.Comm(reduce="int8"|"fp8")``.

A flat gradient viewed as ``[world, S]`` (row ``r``: the chunk rank ``r`` owns) is cut, row by
row, into blocks of ``BLOCK`` elements; each block gets one fp32 scale (its largest magnitude
over the format's largest value) and its elements are stored as int8 or float8 e4m3 codes.
What travels is one byte buffer per row: ``S`` code bytes, then the row's scales as bytes
(``pack``): Gloo cannot send float8 dtypes, and one buffer means one all-to-all.

[Note: quantization blocks]
``BLOCK = 256``. Blocks start at each chunk's first element, so a block never straddles two
ranks' chunks (every block goes to one owner, whole) and the blocks are aligned in the flat
layout: chunks start at multiples of ``S``, a 16-byte multiple (core/layout.py). ``S`` need
not be a multiple of 256: each row's last block is ragged (zero-padded only while its scale
is computed; the padding is never sent). Why 256: the scales cost ``4 / BLOCK`` bytes per
element, 1.6% over the 1 byte of the codes (128 would cost 3.1%, 64 6.3%), while one large
gradient still spoils the resolution of only 256 neighbours (the flat layout puts a
parameter's elements side by side, so a block mostly covers one parameter). int8 keeps
``absmax / 254`` absolute error per element; e4m3 keeps ~2^-4 relative error per element,
down to ``absmax * 2^-9 / 448`` (its subnormals).
"""

from __future__ import annotations

import torch

BLOCK = 256
FP8 = torch.float8_e4m3fn
# format name -> (code dtype, the largest code magnitude the block's absmax is mapped to)
FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "int8": (torch.int8, 127.0),
    "fp8": (FP8, torch.finfo(FP8).max),
}


def blocks_per_row(row: int, block: int = BLOCK) -> int:
    return -(-row // block)


def packed_row_bytes(row: int, block: int = BLOCK) -> int:
    """Bytes one row of ``row`` elements travels in: a code byte each, 4 per block."""
    return row + 4 * blocks_per_row(row, block)


def quantize(rows: torch.Tensor, fmt: str, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` (``[n, S]``, floating) as (codes ``[n, S]`` in the format's dtype, fp32 scales
    ``[n, blocks_per_row(S)]``): ``dequantize(codes, scales)`` approximates ``rows``."""
    code_dtype, top = FORMATS[fmt]
    n, row = rows.shape
    nb = blocks_per_row(row, block)
    padded = rows.new_zeros(n, nb * block, dtype=torch.float32)
    padded[:, :row] = rows
    padded = padded.view(n, nb, block)
    scales = padded.abs().amax(dim=2) / top  # [n, nb]
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block: codes 0
    scaled = padded / safe.unsqueeze(2)
    if code_dtype is torch.int8:
        codes = scaled.round_().clamp_(-top, top).to(torch.int8)
    else:  # round to nearest e4m3; |scaled| <= 448 (up to fp32 rounding: clamp)
        codes = scaled.clamp_(-top, top).to(code_dtype)
    return codes.view(n, nb * block)[:, :row].contiguous(), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """fp32 ``[n, S]`` from ``quantize``'s codes and scales."""
    n, row = codes.shape
    nb = scales.shape[1]
    padded = codes.new_zeros(n, nb * block)
    padded[:, :row] = codes
    values = padded.view(n, nb, block).float() * scales.unsqueeze(2)
    return values.view(n, nb * block)[:, :row]


def pack(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Codes and scales into the uint8 rows ``out`` (``[n, packed_row_bytes(S)]``)."""
    row = codes.shape[1]
    out[:, :row] = codes.view(torch.uint8)  # fp8 as its bytes: Gloo has no float8 type
    out[:, row:] = scales.view(torch.uint8)
    return out


def unpack(packed: torch.Tensor, fmt: str, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``pack``: (codes ``[n, row]``, fp32 scales ``[n, nb]``)."""
    code_dtype = FORMATS[fmt][0]
    codes = packed[:, :row].contiguous().view(code_dtype)
    scales = packed[:, row:].contiguous().view(torch.float32)
    return codes, scales
