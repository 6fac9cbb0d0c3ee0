"""``FLATSHARD_DEBUG=1``: check, before every collective, that all ranks issue the same one.

Ranks that take different code paths (a unit skipped on one rank, a state dict gathered on one
rank while the other trains) issue mismatched collectives; Gloo and NCCL then hang or pair
unrelated buffers. In debug mode every collective is preceded by a tiny all-gather of
``(sequence number, hash of op + unit + shape + dtype)`` on the same group. Because every rank
precedes *every* collective with such a check, the k-th checks always meet each other, and a
difference is reported on every rank, naming what each side was about to do. It costs one
small blocking collective per collective: for debugging, not for production runs.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist


class OpChecker:
    """Per-model sequence counters and the cross-rank comparison."""

    def __init__(self) -> None:
        self.sequence: dict[int, int] = {}

    def check(self, group: dist.ProcessGroup, op: str, tensor: torch.Tensor, label: str) -> None:
        what = f"{op} of {label or 'an unlabelled tensor'} {tuple(tensor.shape)} {tensor.dtype}"
        seq = self.sequence[id(group)] = self.sequence.get(id(group), 0) + 1
        digest = int(hashlib.sha1(what.encode()).hexdigest()[:15], 16)
        mine = torch.tensor([seq, digest], dtype=torch.int64, device=tensor.device)
        world = dist.get_world_size(group)
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine, group=group)
        if all(torch.equal(e, everyone[0]) for e in everyone):
            return
        descriptions: list[str | None] = [None] * world
        dist.all_gather_object(descriptions, f"#{seq}: {what}", group=group)
        lines = "; ".join(f"group rank {r} issues {d}" for r, d in enumerate(descriptions))
        rank = dist.get_rank()  # world: the global rank names this process in messages
        raise RuntimeError(
            f"[flatshard rank {rank}] collective mismatch (FLATSHARD_DEBUG): {lines}. "
            "Every rank must run the same forward/backward/state-dict calls in the same order."
        )
