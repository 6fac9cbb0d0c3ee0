"""Tensor parallelism (Megatron-style, torchtitan's plan) composed with flatshard's sharding.

[Note: the estimator's tensor parallelism]
The plan is torchtitan's for Llama (its ``apply_tp``). flatshard composes with it as FSDP2
does: ``parallelize_module`` on the tp mesh first, then ``fs.shard(model, mesh=dp_mesh)``
(``parallel/tensor.py``). What one GPU holds:

* colwise ``wq``/``wk``/``wv``/``w1``/``w3`` (output features split) and rowwise ``wo``/``w2``
  (input features split): every block matrix is 1/tp. A head is never split, so ``heads``,
  ``kv_heads`` and ``ffn`` must be multiples of tp;
* the embedding rowwise (vocabulary rows split) and the output head colwise with loss
  parallel (the logits stay vocabulary-sharded): 1/tp, rank 0 holding ceil(vocab/tp) rows;
* the norm weights (``SequenceParallel``) replicated over tp: only the dp sharding divides them.

flatshard flattens each GPU's local tensors into its units like any parameter, so the dp
sharding, the gathered buffers and the dp collectives all work on tp's share: the memory
replay runs unchanged on :func:`local_spec`, a spec of one TP rank's share. Two engine
differences: units holding TP parameters never borrow the gather pool's buffers (they gather
into their own), so ``Units.pooled`` is False with tp > 1; and the root is never lazy
(``root_split.worth_lazy``: autograd saves DTensors, which the lazy root's hooks cannot
rebuild), so it stays gathered from forward into backward.

Activations (``activations.py``) with sequence parallelism (torchtitan always uses it): the
residual stream and the norms' inputs and statistics are split over the sequence (1/tp);
attention and the MLP hold tp's share of the heads and of ffn (1/tp); the all-gathered norm
output that the colwise matmuls save stays whole, because DTensor saves the gathered tensor
(Megatron-LM re-gathers it in backward instead, hence Korthikanti et al.'s 34/t). Without
sequence parallelism the norms and the residual stream are replicated (whole).

Traffic per step of one data-parallel rank (its micro-batch, message ``M = batch*seq*hidden``
activation bytes), with SP: each block all-gathers a norm output twice in forward (before
attention, before the MLP) and reduce-scatters ``wo``'s and ``w2``'s outputs twice; backward
mirrors it (an all-gather's backward is a reduce-scatter and vice versa); activation
checkpointing runs the forward's again (torchtitan's selective AC only the all-gathers: it
saves the reduce-scatters' outputs). The embedding reduce-scatters in forward and
all-gathers in backward, the head the other way round. Without SP the same points are
all-reduces, one per pair: the same bus bytes. Loss parallel's per-token statistics (a few
fp32 all-reduces of ``batch*seq`` elements) are left out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flatshard.tools.estimate.spec import Layout, ModelSpec, Workload

__all__ = [
    "TPTraffic",
    "backward_share",
    "check_workload",
    "local_spec",
    "seq_shards",
    "tp_traffic",
]


def _require_multiple(name: str, value: int, tp: int, why: str, fix: str = "") -> None:
    if value % tp:
        raise ValueError(
            f"{name}={value} is not divisible by --tp {tp} ({why}): {fix}choose a --tp that "
            f"divides it"
        )


def local_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """One TP rank's share of ``spec``: its heads, key/value heads, MLP width and vocabulary
    rows (rank 0: the rounded-up share), the hidden width and head size unchanged. ``spec``
    itself when ``tp == 1``."""
    if tp == 1:
        return spec
    _require_multiple("heads", spec.heads, tp, "a head is never split")
    _require_multiple("kv_heads", spec.kv_heads, tp, "torchtitan's plan splits them too")
    _require_multiple("ffn", spec.ffn, tp, "each GPU holds ffn/tp MLP columns",
                      f"give --ffn a multiple of {tp} (Llama 3 70B: 28672; without --ffn it "
                      "is solved from --params) or ")  # fmt: skip
    return dataclasses.replace(
        spec,
        heads=spec.heads // tp,
        kv_heads=spec.kv_heads // tp,
        ffn=spec.ffn // tp,
        vocab=-(-spec.vocab // tp),
        head_dim=spec.head_size,
    )


def seq_shards(layout: Layout) -> int:
    """How many pieces the sequence-parallel regions (residual stream, norms) are split in."""
    return layout.tp if layout.sequence_parallel else 1


def check_workload(layout: Layout, work: Workload) -> None:
    """Sequence parallelism splits each sequence evenly over the tp ranks."""
    if seq_shards(layout) > 1 and work.seq % layout.tp:
        raise ValueError(
            f"seq={work.seq} is not divisible by --tp {layout.tp}: sequence parallelism splits "
            f"the sequence; use a --seq multiple of {layout.tp} or --no-sequence-parallel"
        )


@dataclass(frozen=True)
class TPTraffic:
    """The tensor-parallel collectives of one step, per GPU (none with tp = 1). Bus bytes as
    nccl-tests counts them (``steptime.py``)."""

    message: int
    """Bytes of one whole ``[batch, seq, hidden]`` activation in the compute dtype."""
    all_gathers: int
    """All-gathers per step (sequence parallel), each of ``message`` bytes gathered."""
    reduce_scatters: int
    """Reduce-scatters per step (sequence parallel), each of ``message`` bytes in."""
    all_reduces: int
    """All-reduces per step (without sequence parallel), each of ``message`` bytes."""
    all_gather_bytes: float
    """``message * (tp-1)/tp`` per all-gather."""
    reduce_scatter_bytes: float
    """``message * (tp-1)/tp`` per reduce-scatter."""
    all_reduce_bytes: float
    """``2 * message * (tp-1)/tp`` per all-reduce."""

    @property
    def bus_bytes(self) -> float:
        return self.all_gather_bytes + self.reduce_scatter_bytes + self.all_reduce_bytes


def tp_traffic(spec: ModelSpec, layout: Layout, work: Workload) -> TPTraffic:
    """The TP collectives of one step (see [Note: the estimator's tensor parallelism])."""
    tp = layout.tp
    message = work.tokens * spec.hidden * layout.precision.act
    if tp == 1:
        return TPTraffic(message, 0, 0, 0, 0.0, 0.0, 0.0)
    # forward, backward, and the recomputed forward: whole under full AC; under torchtitan's
    # selective AC only the all-gathers (reduce_scatter_tensor is on its save list)
    gather_passes = 3 if work.act_ckpt or work.selective_ac else 2
    scatter_passes = 3 if work.act_ckpt else 2
    gathers = spec.layers * 2 * gather_passes + 2  # two block halves per pass; embedding, head
    scatters = spec.layers * 2 * scatter_passes + 2
    share = message * (tp - 1) / tp
    if layout.sequence_parallel:
        return TPTraffic(message, gathers, scatters, 0, gathers * share, scatters * share, 0.0)
    return TPTraffic(message, 0, 0, scatters, 0.0, 0.0, 2 * scatters * share)


def backward_share(work: Workload) -> float:
    """The share of the TP bytes moved in backward (one of the passes above): the collectives
    a compiled backward can overlap with the weight-gradient matmuls, which do not wait for
    them."""
    passes = 3 if work.act_ckpt else 2
    if work.selective_ac:
        return 2 / 5  # one all-gather and one reduce-scatter pass of 3 + 2
    return 1 / passes
