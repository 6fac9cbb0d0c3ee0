"""The trainer's data pipeline: documents -> tokens -> packed, rank-balanced micro-batches.

Tokens are bytes (``TOKENIZER``) unless the run passes another tokenizer with the same small
interface (``encode``, ``encode_documents``, ``decode``, ``eos_id``, ``pad_id``,
``vocab_size``): ``--model.hf`` uses the model directory's own (``tools/train/hf_model.py``).

Every rank loads and tokenizes the same documents (the embedded corpus is cached on disk, user
files are read again) and builds the same :class:`~flatshard.packing.PackedBatchSampler`; the
sampler gives each rank its own micro-batches, the same number on every rank, so that the
collectives of forward and backward stay in lockstep.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from flatshard.data import ByteTokenizer, embedded_documents, read_text_documents, train_val_split
from flatshard.packing import PackedBatch, PackedBatchSampler, collate, split_long_documents
from flatshard.tools.train.config import DataConfig

__all__ = ["TOKENIZER", "Corpus", "endless", "load_corpus", "make_sampler", "to_batch"]

TOKENIZER = ByteTokenizer()
Docs = list[list[int]]  # token-id documents, or pieces of at most seq_len of them


@dataclass(frozen=True)
class Corpus:
    """Tokenized training and validation pieces (each at most ``seq_len`` tokens)."""

    train: Docs
    """Training pieces, in document order."""
    val: Docs
    """Validation pieces (empty when there is nothing to hold out)."""
    source: str
    """Where the text came from, for the log."""
    tokenizer: Any = TOKENIZER
    """What made the tokens (and decodes them): the byte tokenizer, or a model's."""

    @property
    def attention_length(self) -> int:
        """Token-weighted mean piece length: the sequence length of attention's FLOPs (a token
        of a packed document attends within its document, not the whole row)."""
        total = sum(len(d) for d in self.train)
        return max(1, round(sum(len(d) ** 2 for d in self.train) / max(1, total)))


def read_documents(cfg: DataConfig) -> tuple[list[str], str]:
    """The raw documents and a description; ``data.path`` errors name the file (and line)."""
    if not cfg.path:
        return embedded_documents(), "embedded corpus (Python's docs and docstrings)"
    found = read_text_documents(cfg.path)
    note = f", {found.skipped_empty} empty skipped" if found.skipped_empty else ""
    return found.documents, f"{cfg.path} ({len(found.files)} file(s){note})"


def tokenized_pieces(texts: list[str], seq_len: int, tokenizer: Any = TOKENIZER) -> Docs:
    """Tokens (+ eos) of every text, long ones cut into pieces of at most ``seq_len``."""
    encoded = tokenizer.encode_documents(texts)
    chunks = split_long_documents([len(d) for d in encoded], seq_len)
    # a 1-token piece (a lone eos after a cut) has no target: drop it
    return [p for c in chunks if len(p := encoded[c.doc][c.start : c.end]) > 1]


def load_corpus(cfg: DataConfig, tokenizer: Any = TOKENIZER) -> Corpus:
    """Read, split and tokenize the documents.

    The split hashes each text (seed 0, whatever the run's seed, so validation losses of runs
    stay comparable) and every rank agrees. A single document (one .txt file) cannot be split
    that way: its last pieces are held out instead.
    """
    texts, source = read_documents(cfg)
    if len(texts) == 1:
        pieces = tokenized_pieces(texts, cfg.seq_len, tokenizer)
        n_val = math.ceil(cfg.val_fraction * len(pieces)) if len(pieces) > 1 else 0
        cut = len(pieces) - n_val
        return Corpus(pieces[:cut], pieces[cut:], source, tokenizer)
    train, val = train_val_split(texts, val_fraction=cfg.val_fraction)
    pieces = [tokenized_pieces(part, cfg.seq_len, tokenizer) for part in (train, val)]
    return Corpus(pieces[0], pieces[1], source, tokenizer)


def make_sampler(
    pieces: Docs, cfg: DataConfig, *, rank: int, world: int, seed: int, train: bool
) -> PackedBatchSampler:
    """Packs ``pieces`` into bins of ``seq_len`` tokens, ``rows`` bins per micro-batch.

    Without packing every piece is given the length ``seq_len``, so each bin (row) holds exactly
    one piece and the rest of the row is padding -- the padded-batch baseline.
    """
    lengths = [len(p) for p in pieces] if cfg.packing else [cfg.seq_len] * len(pieces)
    return PackedBatchSampler(
        lengths,
        cfg.seq_len,
        rank=rank,
        world_size=world,
        micro_batches=cfg.micro_batches if train else 1,
        bins_per_micro_batch=cfg.rows,
        seed=seed,
        shuffle=train,
        algorithm=cfg.algorithm,
    )


def to_batch(
    pieces: Docs,
    indices: list[int],
    cfg: DataConfig,
    device: torch.device,
    pad_id: int = TOKENIZER.pad_id,
) -> PackedBatch:
    """One fixed-shape micro-batch ``[rows, seq_len]`` (all padding when ``indices`` is empty)."""
    docs = [pieces[i] for i in indices]
    return collate(docs, cfg.seq_len, pad_id=pad_id, rows=cfg.rows).to(device)


def endless(sampler: PackedBatchSampler) -> Iterator[list[list[int]]]:
    """This rank's micro-batches step after step, epoch after epoch, from the sampler's position
    (so a sampler restored from a checkpoint continues where it stopped)."""
    epoch = sampler.epoch
    while True:
        sampler.set_epoch(epoch)  # the same epoch keeps the restored position
        yield from sampler
        epoch += 1


def validation_steps(
    pieces: Docs, cfg: DataConfig, *, rank: int, world: int, count: int
) -> list[list[int]]:
    """The first ``count`` validation micro-batches of this rank (fixed, unshuffled): the same
    number on every rank, fewer only if the validation set is smaller."""
    if not pieces or count == 0:
        return []
    sampler = make_sampler(pieces, cfg, rank=rank, world=world, seed=0, train=False)
    steps = []
    for step in sampler:
        steps.extend(step)
        if len(steps) >= count:
            break
    return steps[:count]
