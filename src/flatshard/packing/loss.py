"""Loss normalisation over *global* target tokens.

[Note: why divide by the global count and multiply by world_size]
With packing, ranks and micro-batches hold different numbers of target tokens. The loss we want
is ``L = sum of every token loss in the step / G`` where ``G`` counts the target tokens of all
micro-batches on all ranks. A per-micro-batch ``mean`` would weight a token in a short
micro-batch more than one in a long micro-batch, so instead each micro-batch contributes
``sum(its token losses) / G``, and gradient accumulation simply adds these up.

flatshard (like DDP) *averages* gradients over the ``W`` data-parallel ranks (reduce-scatter with
mean). Rank ``r`` back-propagates ``l_r``; the optimizer sees ``(1/W) * sum_r grad(l_r)``. For that
to equal ``grad(L) = sum_r grad(sum_tokens_r / G)``, each rank must use
``l_r = W * sum_tokens_r / G`` -- hence the explicit ``world_size`` factor of
:func:`packed_cross_entropy`. Pass ``world_size=1`` if your gradient reduction sums instead
of averaging. ``G`` comes from :func:`global_token_count`: one all-reduce of one int per step,
done *before* the first micro-batch's backward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from flatshard.packing.collate import IGNORE_INDEX


def _local_count(labels: int | torch.Tensor | Sequence[torch.Tensor], ignore_index: int) -> int:
    if isinstance(labels, bool):
        raise TypeError("global_token_count got a bool; pass labels tensors or an int count")
    if isinstance(labels, int):
        if labels < 0:
            raise ValueError(f"local token count {labels} is negative; pass a count >= 0")
        return labels
    if isinstance(labels, torch.Tensor):
        return int((labels != ignore_index).sum())
    return sum(int((t != ignore_index).sum()) for t in labels)


def _reduce_device(group: dist.ProcessGroup | None) -> torch.device:
    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_token_count(
    labels: int | torch.Tensor | Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    *,
    ignore_index: int = IGNORE_INDEX,
) -> int:
    """Number of target tokens of this step over all ranks of ``group``.

    ``labels`` is this rank's local count (an int), one labels tensor, or the labels of all of
    this rank's micro-batches for the step. Every rank of ``group`` must call this once per step
    (it is one ``all_reduce`` of a single int64); without an initialised process group the local
    count is returned.
    """
    local = _local_count(labels, ignore_index)
    if not (dist.is_available() and dist.is_initialized()):
        return local
    count = torch.tensor([local], dtype=torch.int64, device=_reduce_device(group))
    dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return int(count.item())


def packed_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    global_tokens: int,
    *,
    world_size: int,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """``world_size * sum(token cross-entropy) / global_tokens`` for one micro-batch.

    Args:
        logits: ``[..., vocab]`` (computed in float32 here).
        labels: ``[...]`` pre-shifted targets as built by :func:`collate` (``-100`` = none).
        global_tokens: the step's target tokens over all ranks and micro-batches
            (:func:`global_token_count`).
        world_size: the number of ranks your gradient reduction *averages* over (the
            data-parallel world size for ``fs.shard``/DDP; 1 if gradients are summed). See the
            module note: it makes the averaged gradient equal the gradient of the global mean.

    Summing the returned values over a step's micro-batches (and averaging over ranks, as the
    gradient reduction does) gives the mean token loss of the whole global batch.
    """
    if isinstance(global_tokens, bool) or int(global_tokens) <= 0:
        raise ValueError(
            f"global_tokens={global_tokens!r} must be > 0: the step has no target tokens on any "
            f"rank; count them with global_token_count(labels) and skip empty steps"
        )
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        raise ValueError(
            f"world_size={world_size!r} must be a positive int: the number of ranks gradients "
            f"are averaged over (pass 1 when they are summed)"
        )
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree: logits "
            f"must be labels' shape plus a vocab dimension"
        )
    token_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        labels.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )
    return token_sum * (world_size / int(global_tokens))
