"""Context parallelism (``--cp``): the sequence split over GPUs, ring attention between them.

[Note: the estimator's context parallelism]
torchtitan's CP (``context_parallel`` in ``torch.distributed.tensor.experimental``): each
data-parallel rank's sequences are cut into ``2 x cp`` chunks and GPU ``i`` of the cp group
keeps chunks ``i`` and ``2cp-1-i`` (head-tail load balancing: under a causal mask every GPU
then has the same share of the score matrix). Everything outside attention is per token, so a
GPU holds and computes ``1/cp`` of the tokens. Attention is a ring: each GPU's queries meet
every GPU's keys and values, passed around the cp group one hop per step, ``cp - 1`` hops per
attention call, each overlapped with the attention of the chunk already there.

* **Memory**: FSDP shards over the flattened ``dp x cp`` mesh (torchtitan's ``dp_shard_cp``),
  so the replay runs on a layout of ``world x cp`` data-parallel ranks and a workload of
  ``seq / cp`` tokens per sequence (:func:`cp_view`): activations, logits and their
  gradients are ``1/cp``; the replicated RoPE tables stay whole (``max_seq``). The ring's
  key/value buffers in flight (two chunks' K and V) are a transient of one layer, left out.
* **Compute**: linear and head FLOPs ``1/cp``; attention ``1/cp`` of the whole sequence's
  (``efficiency.step_flops``: ``tokens/cp`` queries, each against ``seq`` keys).
* **Traffic** (:func:`cp_traffic`), per GPU and layer: a hop moves one GPU's K and V,
  ``tokens/cp x 2 x kv_width/tp x bytes``; forward ``cp - 1`` hops (again for the recomputed
  forward under full AC), backward ``2 (cp - 1)`` (the K/V again, and their gradients sent
  back). It overlaps attention's compute only: the exposed part is what exceeds it
  (``steptime.py``). GPUs are numbered tp innermost, then cp (torchtitan's mesh
  ``[dp, cp, tp]``): the ring is within a node while ``cp x tp`` GPUs fit in one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flatshard.tools.estimate.spec import Layout, ModelSpec, Workload

__all__ = ["CPTraffic", "cp_traffic", "cp_view"]


def cp_view(layout: Layout, work: Workload) -> tuple[Layout, Workload]:
    """The layout and workload one GPU of a cp group sees: ``world x cp`` ranks sharding the
    parameters, ``seq / cp`` tokens per sequence. Unchanged at cp 1."""
    cp = layout.cp
    if cp == 1:
        return layout, work
    if work.seq % (2 * cp):
        raise ValueError(
            f"seq={work.seq} is not divisible by 2 x --cp {cp}: head-tail load balancing cuts "
            f"each sequence into {2 * cp} equal chunks; use a --seq multiple of {2 * cp}"
        )
    if work.attention != "flash":
        raise ValueError("--cp needs --attention flash (ring attention keeps no T x T matrix)")
    shard = layout.shard_size * cp if layout.shard_size else None
    flat = dataclasses.replace(layout, world=layout.world * cp, shard_size=shard, cp=1)
    return flat, dataclasses.replace(work, seq=work.seq // cp)


@dataclass(frozen=True)
class CPTraffic:
    """The ring attention's key/value exchange of one step, per GPU (none at cp 1)."""

    hop: int
    """Bytes of one hop: one GPU's keys and values of one layer."""
    hops: int
    """Hops per step: ``layers x (cp-1) x (passes + 2)``, passes = 1 forward (2 with full
    AC, whose backward recomputes it), 2 in backward (K/V and their gradients)."""

    @property
    def bus_bytes(self) -> float:
        return float(self.hop * self.hops)


def cp_traffic(spec: ModelSpec, layout: Layout, work: Workload) -> CPTraffic:
    """The ring's bytes per GPU and step (see [Note: the estimator's context parallelism])."""
    cp = layout.cp
    local_tokens = work.tokens // cp
    kv_width = spec.kv_width // layout.tp
    hop = local_tokens * 2 * kv_width * layout.precision.act
    forward = 2 if work.act_ckpt else 1
    return CPTraffic(hop, spec.layers * (cp - 1) * (forward + 2))
