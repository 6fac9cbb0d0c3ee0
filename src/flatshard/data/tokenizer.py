"""Byte-level tokenizer: UTF-8 bytes are the tokens, plus two special ids.

=========  =====================================================
id         meaning
=========  =====================================================
0..255     the byte with that value
256        ``eos_id``: end of document (appended by ``encode``)
257        ``pad_id``: padding; never produced by ``encode``
=========  =====================================================

``vocab_size`` is 258. Bytes need no training, no files and no downloads, and every string encodes
losslessly; the price is ~4x longer sequences than a BPE vocabulary on English text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

__all__ = ["ByteTokenizer"]


@dataclass(frozen=True)
class ByteTokenizer:
    """Stateless byte-level tokenizer (see the module docstring for the id table)."""

    # ClassVars, not fields: the ids are fixed so that data and checkpoints always agree, and they
    # read the same on the class and on an instance (``ByteTokenizer.eos_id``).
    eos_id: ClassVar[int] = 256
    """End-of-document id, appended by :meth:`encode` when ``add_eos`` is true."""
    pad_id: ClassVar[int] = 257
    """Padding id, for filling fixed-shape batches; ignored by :meth:`decode`."""

    @property
    def vocab_size(self) -> int:
        """Number of ids: 256 bytes + eos + pad = 258."""
        return 258

    def encode(self, text: str, *, add_eos: bool = True) -> list[int]:
        """UTF-8 bytes of ``text`` as ids, followed by ``eos_id`` when ``add_eos``.

        Lone surrogates (which UTF-8 cannot represent) are encoded with ``surrogatepass`` rather
        than raising, so any ``str`` encodes.
        """
        ids = list(text.encode("utf-8", "surrogatepass"))
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the byte ids in ``ids``; special ids are skipped, invalid UTF-8 becomes U+FFFD.

        Accepts any iterable of ints, including a 1-D tensor's ``.tolist()``. Ids outside
        ``[0, vocab_size)`` (e.g. sampled from a padded model vocabulary) are skipped as well.
        """
        data = bytes(i for i in (int(i) for i in ids) if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def encode_documents(self, docs: Sequence[str], *, add_eos: bool = True) -> list[list[int]]:
        """:meth:`encode` each document; one id list per document."""
        return [self.encode(d, add_eos=add_eos) for d in docs]
