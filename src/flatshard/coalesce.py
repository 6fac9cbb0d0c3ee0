"""``fs.Coalesce``: which consecutive small units share one all-gather and one reduce-scatter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MIB = 1 << 20


@dataclass(frozen=True)
class Coalesce:
    """Coalescing of small units (see [Note: coalesced units] in ``features/buckets.py``).

    A collective costs a fixed latency (a few hundred microseconds on Gloo, tens on NCCL)
    besides its bytes, so a model of many small units is latency-bound. Units that run one
    after another in the forward, each at most ``unit_bytes`` gathered, are put in *buckets* of
    at most ``bucket_bytes``; a bucket is one unit over its modules (one flat layout): the
    first use of any member gathers every member in one collective, and the members'
    gradients are reduced in one collective once the last of them (in backward) is done.
    Checkpoints and state dicts are per parameter name and unchanged; the fragments' ranges
    follow the bucket's layout. Results are bit-identical with and without over a shard group
    of two ranks, and equal to rounding over more (the ring's summation order follows an
    element's chunk).

    Buckets are chosen at ``fs.shard`` from the modules' order (``model.modules()``: a parent
    before its children, siblings in registration order) and used from the first step on; the
    first iteration's forward order checks them (a warning names a bucket whose members did
    not run one after another). ``buckets`` replaces the automatic choice by an explicit one.
    """

    unit_bytes: int = 2 * MIB
    """Largest unit (its gathered parameters, in the compute dtype) that is coalesced
    automatically; 0 turns automatic coalescing off."""

    bucket_bytes: int = 8 * MIB
    """Largest bucket: the most gathered bytes held at once for one bucket (the next bucket
    may be prefetched while one computes, as with ``Prefetch``)."""

    buckets: tuple[tuple[str, ...], ...] | None = None
    """Explicit buckets, by module name (as in ``model.named_modules()``, the units the policy
    chose), e.g. ``(("layers.0", "layers.1"), ("layers.2", "layers.3"))``. Each bucket's
    members should run one after another; sizes are not limited. ``None``: automatic."""

    def __post_init__(self) -> None:
        for name in ("unit_bytes", "bucket_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(
                    f"Coalesce({name}={value!r}): a number of bytes, 0 or more "
                    "(e.g. 2 << 20 for 2 MiB)"
                )
        if self.buckets is not None:
            object.__setattr__(self, "buckets", _normalize(self.buckets))

    @property
    def enabled(self) -> bool:
        return self.buckets is not None or self.unit_bytes > 0


def _normalize(buckets: Any) -> tuple[tuple[str, ...], ...]:
    if isinstance(buckets, str) or not hasattr(buckets, "__iter__"):
        raise ValueError(
            f"Coalesce(buckets={buckets!r}): pass a list of buckets, each a list of module "
            "names, e.g. [['layers.0', 'layers.1']]"
        )
    out = []
    for bucket in buckets:
        if isinstance(bucket, str) or not all(isinstance(n, str) for n in bucket):
            raise ValueError(
                f"Coalesce(buckets=...): bucket {bucket!r} must be a list of module names "
                "(strings), e.g. ['layers.0', 'layers.1']"
            )
        if len(bucket) < 2:
            raise ValueError(
                f"Coalesce(buckets=...): bucket {list(bucket)!r} has fewer than two modules; "
                "a bucket coalesces two or more units"
            )
        out.append(tuple(bucket))
    seen: set[str] = set()
    for name in (n for b in out for n in b):
        if name in seen:
            raise ValueError(
                f"Coalesce(buckets=...): module {name!r} appears in two buckets; each unit "
                "belongs to at most one"
            )
        seen.add(name)
    return tuple(out)
