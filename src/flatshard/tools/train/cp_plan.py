"""``flatshard train --parallelism.cp N``: context parallelism, every row split over N ranks.

[Note: the trainer's (dp, cp) layout]
With ``parallel.cp = N > 1`` the ``world`` ranks form a mesh ``("dp", "cp")`` of shape
``(world // N, N)``; the ranks of one cp group are consecutive. The GPT's attention is made
context-parallel over ``mesh["cp"]`` (:func:`flatshard.models.context_parallel.attach`, see
[Note: head-tail context parallelism] there; ``parallel.cp_attention`` picks the ring or the
all-gather) and ``fs.shard`` shards over *all* ``world`` ranks:
the flattened dp x cp mesh, as torchtitan does. That is exact because every parameter's
gradient is a sum over tokens, and the cp ranks hold disjoint tokens.

* **Data.** The cp ranks of a dp group read the same micro-batches (the sampler is built for
  dp rank ``rank // N`` of ``world // N``); each keeps its head-tail share of every row
  (:func:`local_batch`): chunks ``r`` and ``2N - 1 - r`` of ``2N``, tokens, labels, positions
  in their documents (RoPE) and document ids (the attention mask) alike.
* **Loss and metrics.** The trainer's reductions stay on the world group, and each token is
  counted on exactly one rank: the global target count, the loss normalised by it (times the
  world size that the gradient reduction averages over), the token count and the validation
  sums need no correction.
* **Attention** (``parallel.cp_attention``): ``torch`` is torch's own context parallelism
  (:mod:`flatshard.models.torch_cp_attention`: FlexAttention under its ``_ContextParallel``
  style, trains on accelerators only, rows a multiple of ``cp * 128``), ``ring`` and
  ``allgather`` flatshard's (every device). ``auto`` (the default) is ``torch`` on CUDA where
  the row allows it, else ``ring`` (:func:`resolve_cp_attention`); all three give the same
  attention, so the choice changes speed and memory, not the numbers.
* **Generation** (the final sample) runs with the cp attention inactive: every rank computes
  the whole context, as at cp 1.
* **Refused:** cp with tp, pp, an MoE GPT or ``--model.hf``; a ``data.seq_len`` that 2N does
  not divide; a cp that does not divide the world size; ``cp_attention=torch`` on a CPU or
  with a row it cannot split (:func:`check_cp`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flatshard.models.context_parallel import ContextParallel, attach, split_rows
from flatshard.models.torch_cp_attention import check_row_length, row_fits
from flatshard.packing import PackedBatch
from flatshard.tools.train.config import TrainConfig

__all__ = ["check_cp", "cp_logits", "local_batch", "parallelize", "resolve_cp_attention"]


def check_cp(cfg: TrainConfig, world: int, device_type: str | None = None) -> None:
    """Refuse a cp degree this job cannot use, naming the value and the fix (every rank);
    with ``device_type`` (known on the workers) also a ``cp_attention`` it cannot train with."""
    p, cp = cfg.parallel, cfg.parallel.cp
    if cp == 1:
        return
    if world % cp:
        raise ValueError(
            f"parallel.cp={cp} does not divide the world size {world} (the ranks of the job); "
            f"pass a --parallelism.cp that divides {world}, or start a multiple of {cp} ranks"
        )
    if cfg.data.seq_len % (2 * cp):
        raise ValueError(
            f"data.seq_len={cfg.data.seq_len} is not divisible by 2 * parallel.cp = {2 * cp}: "
            f"head-tail context parallelism cuts every row into 2 * cp chunks; pass a "
            f"--data.seq_len that is a multiple of {2 * cp}"
        )
    for name, value, other in (("tp", p.tp, 1), ("pp", p.pp, 1), ("ep", p.ep, 1)):
        if value != other:
            raise ValueError(
                f"parallel.cp={cp} with parallel.{name}={value} is not supported yet; pass "
                f"--parallelism.{name} 1 (context parallelism composes with data parallelism "
                "only)"
            )
    if cfg.model.experts or cfg.model.hf:
        what = (
            f"model.hf={cfg.model.hf!r}" if cfg.model.hf else f"model.experts={cfg.model.experts}"
        )
        raise ValueError(
            f"parallel.cp={cp} is for the dense GPT, not {what}: its attention is the one made "
            "context-parallel; pass --parallelism.cp 1"
        )
    if p.cp_attention == "torch":
        check_row_length(cfg.data.seq_len, cp)
        if device_type == "cpu":
            raise ValueError(
                "parallel.cp_attention='torch' cannot train on cpu: torch 2.13's FlexAttention "
                "has no CPU backward; pass --parallelism.cp_attention ring (or allgather, or "
                "auto), flatshard's own cp attention on every device"
            )


def resolve_cp_attention(cfg: TrainConfig, device_type: str) -> str:
    """``parallel.cp_attention`` with ``auto`` resolved: torch's on CUDA when the row is a
    multiple of ``cp * 128`` (its block mask's unit), else the ring."""
    chosen = cfg.parallel.cp_attention
    if chosen != "auto":
        return chosen
    fits = row_fits(cfg.data.seq_len, cfg.parallel.cp)
    return "torch" if device_type == "cuda" and fits else "ring"


def parallelize(
    model: nn.Module, device_type: str, world: int, cp: int, attention: str = "ring"
) -> ContextParallel:
    """Make ``model``'s attention context-parallel over its cp group of the ``("dp", "cp")``
    mesh (every rank calls this: building the mesh is collective), by ``attention``
    (``parallel.cp_attention``). Before ``fs.shard``."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (world // cp, cp), mesh_dim_names=("dp", "cp"))
    return attach(model, mesh["cp"], attention)


def local_batch(batch: PackedBatch, cp: int, rank: int) -> PackedBatch:
    """This cp rank's head-tail share of every row of ``batch`` (``[rows, seq_len / cp]``).

    ``cu_seqlens`` and ``max_seqlen`` still describe the whole rows: the cp attention masks by
    ``document_ids`` instead, and :func:`cp_logits` does not pass them to the model."""
    return PackedBatch(
        input_ids=split_rows(batch.input_ids, cp, rank),
        labels=split_rows(batch.labels, cp, rank),
        position_ids=split_rows(batch.position_ids, cp, rank),
        cu_seqlens=batch.cu_seqlens,
        max_seqlen=batch.max_seqlen,
        document_ids=split_rows(batch.document_ids, cp, rank),
    )


def cp_logits(model: Any, context: ContextParallel, batch: PackedBatch) -> torch.Tensor:
    """``[rows, seq_len / cp, vocab]`` logits of this rank's share (:func:`local_batch`)."""
    with context.attending(batch.document_ids):
        return model(batch.input_ids, batch.position_ids)
