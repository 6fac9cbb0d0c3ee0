"""``flatshard train --parallelism.tp N``: tensor parallelism inside each data-parallel rank.

[Note: the trainer's (dp, tp) layout]
With ``parallel.tp = N > 1`` the ``world`` ranks form a mesh ``("dp", "tp")`` of shape
``(world // N, N)``: the ranks of one tp group are consecutive (torchtitan's order), so on a
machine the tp peers share the fast links. ``hybrid_shard`` adds its machine dim in front:
``("replicate", "shard", "tp")``. The model is made tensor-parallel on ``mesh["tp"]``
(:func:`~flatshard.models.tensor_parallel.parallelize_gpt`, SequenceParallel on, or
:func:`~flatshard.models.tensor_parallel.parallelize_hf` for ``--model.hf``) and then sharded
by ``fs.shard`` over the data-parallel dims.

* **Data.** Every tp rank of a dp group reads the same micro-batches: the sampler is built for
  the dp rank ``rank // N`` of ``world // N`` (:func:`dp_rank_size`).
* **Loss and metrics.** The trainer's reductions stay on the world group: each quantity is
  counted ``N`` times (once per tp rank), which cancels in the token-normalised loss and in the
  validation mean; only the token count is divided by ``N``. Logging stays on global rank 0.
* **Sequence parallelism** splits every row's ``seq_len`` tokens over the tp ranks, so
  ``data.seq_len`` must divide by ``N``; the final text sample pads its context on the right to
  a multiple of ``N`` (causal attention: padding after the last token changes nothing before).
* **loss_parallel** keeps the logits split over the vocabulary and computes the loss inside
  torch's ``loss_parallel()``; evaluation and sampling gather the logits (``full_tensor``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from flatshard.tools.train.config import TrainConfig

__all__ = [
    "build_mesh",
    "check_tp",
    "dp_rank_size",
    "full_logits",
    "generate",
    "loss_context",
    "parallelize",
    "sampling_model",
    "scalar",
]


def check_tp(cfg: TrainConfig, world: int) -> None:
    """Refuse a tp degree this job cannot use, naming the value and the fix (every rank)."""
    tp = cfg.parallel.tp
    if world % tp:
        raise ValueError(
            f"parallel.tp={tp} does not divide the world size {world} (the ranks of the job); "
            f"pass a --parallelism.tp that divides {world}, or start a multiple of {tp} ranks"
        )
    if tp > 1 and cfg.parallel.loss_parallel and cfg.model.hf:
        raise ValueError(
            f"parallel.loss_parallel=true is for the GPT; model.hf={cfg.model.hf!r} computes "
            "its loss from gathered logits: pass --parallelism.loss_parallel false"
        )
    if tp > 1 and cfg.data.seq_len % tp:
        raise ValueError(
            f"data.seq_len={cfg.data.seq_len} is not divisible by parallel.tp={tp}: sequence "
            f"parallelism splits every row over the tp ranks; pass a --data.seq_len that is a "
            f"multiple of {tp}"
        )


def dp_rank_size(rank: int, world: int, tp: int) -> tuple[int, int]:
    """This rank's data-parallel rank and the data-parallel size (tp groups are consecutive)."""
    return rank // tp, world // tp


def build_mesh(device_type: str, world: int, local_world: int, tp: int, hybrid: bool) -> Any:
    """The job's DeviceMesh: ``("dp", "tp")``, or ``("replicate", "shard", "tp")`` for
    hybrid_shard (replicate across machines, shard within one)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not hybrid:
        return init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    if local_world % tp or world % local_world:
        raise ValueError(
            f"parallel.strategy='hybrid_shard' with parallel.tp={tp} needs the same number of "
            f"workers on every machine, a multiple of tp; this machine has {local_world} of a "
            f"world of {world}: use full_shard, or a tp that divides {local_world}"
        )
    shape = (world // local_world, local_world // tp, tp)
    return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard", "tp"))


def data_parallel_mesh(mesh: Any) -> Any:
    """``fs.shard``'s ``mesh=``: every dim of ``mesh`` but ``tp``."""
    rest = tuple(name for name in mesh.mesh_dim_names if name != "tp")
    return mesh[rest[0]] if len(rest) == 1 else mesh[rest]


def parallelize(model: nn.Module, mesh: Any, cfg: TrainConfig) -> nn.Module:
    """Apply the tensor-parallel plan of flatshard's GPT or of a Hugging Face model."""
    from flatshard.models import GPT
    from flatshard.models.tensor_parallel import parallelize_gpt, parallelize_hf

    if isinstance(model, GPT):
        return parallelize_gpt(model, mesh["tp"], loss_parallel=cfg.parallel.loss_parallel)
    return parallelize_hf(model, mesh["tp"])


def loss_context(cfg: TrainConfig) -> AbstractContextManager:
    """torch's ``loss_parallel()`` when the logits stay split over the vocabulary."""
    if cfg.parallel.tp > 1 and cfg.parallel.loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return nullcontext()


def _is_dtensor(tensor: object) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def scalar(tensor: torch.Tensor) -> torch.Tensor:
    """A (replicated) DTensor loss as a plain tensor; a plain tensor unchanged."""
    return tensor.full_tensor() if _is_dtensor(tensor) else tensor


def full_logits(logits: torch.Tensor) -> torch.Tensor:
    """Logits split over the vocabulary (loss_parallel) gathered; plain logits unchanged."""
    return logits.full_tensor() if _is_dtensor(logits) else logits


def sampling_model(
    forward: Callable[[torch.Tensor], torch.Tensor], tp: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``forward`` (``[B, T]`` ids -> ``[B, T, V]`` logits) for any ``T``: the ids are padded on
    the right to a multiple of ``tp`` (sequence parallelism), the logits cut back and gathered."""

    def logits(ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        pad = -length % tp
        if pad:
            ids = torch.cat([ids, ids[:, -1:].expand(-1, pad)], dim=1)  # [B, T + pad]
        return full_logits(forward(ids))[:, :length]  # [B, T, V]

    return logits


@torch.no_grad()
def generate(
    model: nn.Module, ids: torch.Tensor, tokens: int, tp: int, generator: torch.Generator
) -> torch.Tensor:
    """The trainer's final sample (top-20 at temperature 0.8, as at tp 1) from a
    tensor-parallel GPT or Hugging Face model: every rank the same ids, one forward per token."""
    from flatshard.models import GPT
    from flatshard.models.sampling import generate as sample

    if isinstance(model, GPT):
        forward, limit = model, model.config.max_seq_len
    else:
        forward = lambda x: model(input_ids=x, use_cache=False).logits  # noqa: E731
        limit = getattr(model.config, "max_position_embeddings", None) or 1 << 30
    limit -= limit % tp  # the padded context must still fit the positions
    logits = sampling_model(forward, tp)
    return sample(logits, ids, tokens, max_seq_len=limit, temperature=0.8, top_k=20,
                  generator=generator)  # fmt: skip
