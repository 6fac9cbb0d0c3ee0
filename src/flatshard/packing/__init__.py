"""Variable-length sequence packing without cross-contamination.

* :func:`pack` / :func:`pack_chunks` / :func:`split_long_documents` -- documents into bins.
* :func:`bucket_by_length` -- the padded-batch alternative; :func:`packing_report` -- efficiency.
* :func:`collate` -> :class:`PackedBatch` -- ``input_ids``/``labels``/``position_ids`` and the
  ``cu_seqlens``/``max_seqlen`` of flash-attention's varlen format.
* :func:`varlen_attention` -- attention that never crosses a document boundary;
  :func:`document_attention_mask` -- the same as an explicit mask (for Hugging Face models).
* :class:`PackedBatchSampler` -- bins to data-parallel ranks, balanced and resumable.
* :func:`global_token_count` / :func:`packed_cross_entropy` -- loss over global target tokens.

See ``docs/packing.md`` for the conventions.
"""

from flatshard.packing.attention import document_attention_mask, varlen_attention
from flatshard.packing.binpack import ALGORITHMS, Chunk, pack, pack_chunks, split_long_documents
from flatshard.packing.bucketing import bucket_by_length, padding_efficiency
from flatshard.packing.collate import IGNORE_INDEX, PackedBatch, collate
from flatshard.packing.loss import global_token_count, packed_cross_entropy
from flatshard.packing.report import PackingReport, packing_report
from flatshard.packing.sampler import PackedBatchSampler, StepPlan

__all__ = [
    "ALGORITHMS",
    "IGNORE_INDEX",
    "Chunk",
    "PackedBatch",
    "PackedBatchSampler",
    "PackingReport",
    "StepPlan",
    "bucket_by_length",
    "collate",
    "document_attention_mask",
    "global_token_count",
    "pack",
    "pack_chunks",
    "packed_cross_entropy",
    "packing_report",
    "padding_efficiency",
    "split_long_documents",
    "varlen_attention",
]
