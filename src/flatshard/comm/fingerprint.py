"""Cross-rank agreement check at ``fs.shard`` time.

Ranks that shard different models (another config, another wrap plan, another strategy) would
issue mismatched collectives and hang or silently mix data. Before anything else is
communicated, every rank describes what it is about to shard; a digest of that description is
all-gathered, and on a mismatch the descriptions themselves are compared to name the first
difference.
"""

from __future__ import annotations

import hashlib

import torch.distributed as dist


def check_ranks_agree(lines: list[str], group: dist.ProcessGroup | None) -> None:
    """Raise ``ValueError`` naming the first line where some rank's description differs
    (``group=None``: this rank alone, nothing to compare)."""
    world = dist.get_world_size(group) if group is not None else 1
    if world == 1:
        return
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    digests: list[str | None] = [None] * world
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) == 1:
        return
    everyone: list[list[str] | None] = [None] * world
    dist.all_gather_object(everyone, lines, group=group)
    rank = dist.get_rank()  # world: the global rank names this process in messages
    raise ValueError(
        f"[flatshard rank {rank}] ranks disagree on the model: {_first_diff(everyone, group)}"
    )


def _first_diff(descriptions: list, group: dist.ProcessGroup) -> str:
    """The first differing line, naming global ranks (the group's rank 0 is the reference)."""
    reference = descriptions[0]
    first = dist.get_global_rank(group, 0)
    for other_rank, other in enumerate(descriptions[1:], start=1):
        for i in range(max(len(reference), len(other))):
            a = reference[i] if i < len(reference) else "<missing>"
            b = other[i] if i < len(other) else "<missing>"
            if a != b:
                return (
                    f"rank {first} has {a!r} where rank "
                    f"{dist.get_global_rank(group, other_rank)} has {b!r}. Every rank must build "
                    "the same model with the same fs.shard arguments."
                )
    return "descriptions differ only in order"
