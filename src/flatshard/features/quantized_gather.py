"""``fs.Comm(gather="int8"|"fp8"|"bf16")``: parameters all-gathered in a narrower wire format
(ZeRO++'s quantized weight gather, "qwZ").

[Note: quantized weight gather]
Which groups: a floating group whose compute dtype is wider than the wire (int8/fp8: any of
fp32/bf16/fp16; bf16: fp32 only), sharded over more than one rank, and not a torchao float8
group (those gather float8 bytes already: [Note: float8 all-gather]). Every other group, and
every group when ``gather`` is None, takes core/gather.py's path unchanged.

* **Send side.** This rank's shard (the fp32 master, not its compute-dtype cast: one rounding,
  not two) is quantized blockwise (comm/quantize.py, [Note: quantization blocks]: blocks start
  at the shard's first element, so each is local) into its own row of a separate ``received``
  buffer (uint8 ``[world, S + 4 * blocks]``: codes, then fp32 scales; bf16: ``[world, S]``
  bf16), and the rows are all-gathered in place.
* **Receive side.** At the wait (``PendingWork.add_then``: on the stream that waits, rule 3 of
  [Note: streams and buffer lifetimes] in core/streams.py) every row is dequantized into the
  group's ``full`` buffer in the compute dtype, one row at a time (one fp32 row of scratch).
  ``received`` is allocated on the compute stream (rule 1) and held by the ``PendingWork``
  until that wait (rule 4). The module's views are of ``full`` as always.
* **Forward and backward agree.** Quantizing is deterministic, so the regather before
  backward writes the same bytes into ``full`` as the forward's gather ([Note: full buffer
  lifetime] in core/flat_group.py relies on that: autograd's saved views are not re-versioned).
* **Gradients** are those of the dequantized weights, reduced as ``Comm.reduce`` says; the
  optimizer steps the fp32 masters, so quantization error does not accumulate in the weights.
* **Bytes.** ``fs.comm_stats``' ``all_gather`` counts the row sent: int8/fp8 ``S + 4 *
  ceil(S / 256)`` bytes, bf16 ``2 * S``.
* **Refused** (core/options.py): CPU offload of parameters and tensor-parallel parameters
  (untested paths), and ``fs.summon_full_params`` (its write-back would store the
  quantized weights into the masters; read them with ``fs.full_state_dict``).
"""

from __future__ import annotations

from typing import Any

import torch

from flatshard.comm import quantize
from flatshard.comm.collectives import CommStats, PendingWork, all_gather_into
from flatshard.core.streams import on_side_stream
from flatshard.precision import QUANTIZED_WIRES, REDUCE_WIRES, wire_dtype

# ``FlatGroup`` and ``Topology`` (core/) import core/gather.py, which imports this module.
FlatGroup = Any
Topology = Any


def applies(group: FlatGroup, wire: str | None) -> bool:
    """Does ``group`` gather in the ``fs.Comm(gather=wire)`` format (see the [Note])?"""
    if wire is None or group.float8 is not None or group.world == 1:
        return False
    return wire_dtype(wire, group.compute_dtype) is not None


def start(group: FlatGroup, topo: Topology, stats: CommStats, label: str) -> PendingWork:
    """Async: every rank's encoded shard of ``group``, decoded into ``full`` at the wait."""
    wire = stats.gather_wire
    received = _received(group, wire)  # on the compute stream (rule 1)
    full = group.full.data  # this gather's buffer (a later one may be another)
    with on_side_stream(topo.streams, "gather"):
        own = received[group.rank]
        encode(group.shard, wire, own)
        pending = all_gather_into(received.view(-1), own, topo.shard_group, stats, label)
    pending.add_then(lambda _: decode(received, wire, full))
    return pending


def _received(group: FlatGroup, wire: str) -> torch.Tensor:
    if wire in QUANTIZED_WIRES:
        row = quantize.packed_row_bytes(group.shard_numel)
        return torch.empty(group.world, row, dtype=torch.uint8, device=group.device)
    dtype = REDUCE_WIRES[wire]
    return torch.empty(group.world, group.shard_numel, dtype=dtype, device=group.device)


def encode(shard: torch.Tensor, wire: str, dest: torch.Tensor) -> None:
    """``shard`` (1-D) as it travels, into ``dest`` (one row of ``received``)."""
    if wire in QUANTIZED_WIRES:
        codes, scales = quantize.quantize(shard.detach().unsqueeze(0), wire)
        quantize.pack(codes, scales, dest.unsqueeze(0))
    else:
        dest.copy_(shard)


def decode(received: torch.Tensor, wire: str, full: torch.Tensor) -> None:
    """Every row of ``received`` into its chunk of ``full`` (in ``full``'s dtype)."""
    rows = full.view(received.shape[0], -1)
    if wire not in QUANTIZED_WIRES:
        rows.copy_(received)
        return
    for packed, dest in zip(received, rows, strict=True):  # one fp32 row of scratch at a time
        codes, scales = quantize.unpack(packed.unsqueeze(0), wire, dest.numel())
        dest.copy_(quantize.dequantize(codes, scales)[0])
