"""Deterministic train/validation split by content hash.

Each document goes to validation when a keyed hash of its text falls below ``val_fraction``. The
decision depends only on the text and the seed, never on list order or a random generator, so every
rank, run and machine agrees, adding documents never moves existing ones, and duplicates land on the
same side (no leakage of a validation document into training).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

__all__ = ["train_val_split"]


def _unit_hash(doc: str, seed: int) -> float:
    """Map ``(doc, seed)`` to a uniform-looking float in [0, 1)."""
    h = hashlib.blake2b(doc.encode("utf-8", "surrogatepass"), digest_size=8, key=_key(seed))
    return int.from_bytes(h.digest(), "big") / 2.0**64


def _key(seed: int) -> bytes:
    return seed.to_bytes(16, "big", signed=True)


def train_val_split(
    docs: Sequence[str], val_fraction: float = 0.01, seed: int = 0
) -> tuple[list[str], list[str]]:
    """Split ``docs`` into ``(train, val)``, both in their original order.

    About ``val_fraction`` of the documents go to ``val``. With ``val_fraction > 0`` and at least
    two documents, both sides are guaranteed non-empty (the document with the smallest, resp.
    largest, hash is moved), so a tiny user dataset still gets a validation loss.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(
            f"val_fraction={val_fraction!r} is out of range; use a value in [0, 1), e.g. 0.01"
        )
    if not isinstance(seed, int) or not -(2**127) <= seed < 2**127:
        raise ValueError(f"seed={seed!r} must be an int that fits in 128 bits, e.g. 0")
    if val_fraction == 0.0 or len(docs) < 2:
        return list(docs), []
    scores = [_unit_hash(d, seed) for d in docs]
    is_val = [s < val_fraction for s in scores]
    if not any(is_val):
        is_val[min(range(len(docs)), key=scores.__getitem__)] = True
    if all(is_val):
        is_val[max(range(len(docs)), key=scores.__getitem__)] = False
    train = [d for d, v in zip(docs, is_val, strict=True) if not v]
    val = [d for d, v in zip(docs, is_val, strict=True) if v]
    return train, val
