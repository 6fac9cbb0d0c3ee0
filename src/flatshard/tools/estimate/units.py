"""The units flatshard builds for the reference GPT under a layout, as element counts.

[Note: the estimator's units]
``fs.shard(GPT(cfg), policy=fs.wrap.by_type(Block))`` with the engine's defaults makes one unit
per block and the root unit, which owns what no block owns:

* ``split_root=True`` (default; ``features/root_split.py``): the root's parameters used only after
  the last block (the final norm, and an untied head) form a second unit over the root module,
  the *tail*. A tied head is the embedding's parameter, so it stays in the root.
* With a tail, under full_shard/hybrid_shard, a root of at least ``LAZY_MIN_BYTES`` (1 MiB in
  the stored dtype) is *lazy* (``features/lazy_root.py``): released after the forward and
  regathered in backward only when a saved tensor views it. A tied head's weight is saved by
  ``lm_head``, so the root is regathered at the head's backward and held to the end; an untied
  model's root (the embedding, whose backward reads no weight) is never regathered. A smaller
  root stays gathered from forward into backward, as the tail does.
* Coalescing (``fs.Coalesce()`` defaults, ``features/buckets.py``): at ``fs.shard``, runs of
  consecutive blocks of at most ``unit_bytes`` gathered each are *buckets* of at most
  ``bucket_bytes``; the root and the tail are never coalesced, and neither is anything under
  no_shard. A bucket is one unit over its blocks (one flat layout, padded once: its
  ``bucket_units`` entry), gathered into one private buffer (never the gather pool's) and
  reduced once, after the backward of its first block in forward order.

Sizes are padded to a multiple of the shard group as ``engine.layout`` pads them (the 16-byte
alignment gaps between parameters are left out: none in the presets).
"""

from __future__ import annotations

from dataclasses import dataclass

from flatshard.coalesce import Coalesce
from flatshard.features.root_split import LAZY_MIN_BYTES
from flatshard.tools.estimate.spec import Layout, ModelSpec
from flatshard.tools.estimate.tp_cost import local_spec

__all__ = ["Unit", "Units", "plan_units"]

COALESCE = Coalesce()  # fs.shard's default


@dataclass(frozen=True)
class Unit:
    """One unit: its parameters' sizes in flat order, padded and per-rank element counts."""

    name: str
    sizes: tuple[int, ...]
    pad: int
    shard: int

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    @property
    def used(self) -> int:
        """Parameter elements in rank 0's shard (the padding lies at the end, on the last rank)."""
        return min(self.numel, self.shard)


@dataclass(frozen=True)
class Units:
    """The units of one layout and how the engine treats them."""

    root: Unit
    tail: Unit | None
    """The root's tail (final norm, untied head); ``None`` with ``split_root=False``."""
    block: Unit
    layers: int
    buckets: tuple[tuple[int, ...], ...]
    """Block indices of each bucket (forward order); blocks in none are gathered alone."""
    bucket_units: tuple[Unit, ...]
    """The unit each bucket is (its blocks' parameters in one layout), as ``buckets``."""
    lazy_root: bool
    """The root reshards after forward (see the Note)."""
    root_regathered: bool
    """The lazy root is gathered again in backward (a tied head's saved weight)."""
    pooled: bool
    """The model has a gather pool (full_shard/hybrid_shard): blocks gathered alone borrow
    its buffers."""

    @property
    def all(self) -> list[Unit]:
        """Every unit once (a bucket as one, a block in none once each)."""
        alone = self.layers - sum(len(b) for b in self.buckets)
        tail = [self.tail] if self.tail else []
        return [self.root, *tail, *[self.block] * alone, *self.bucket_units]

    @property
    def shards(self) -> int:
        return sum(u.shard for u in self.all)

    @property
    def used(self) -> int:
        return sum(u.used for u in self.all)

    def bucket_of(self, block: int) -> tuple[int, ...] | None:
        return next((b for b in self.buckets if block in b), None)

    def unit_of(self, key: int | tuple[int, ...]) -> Unit:
        """A block's unit, or a bucket's (``key``: the bucket's block indices)."""
        if isinstance(key, tuple):
            return self.bucket_units[self.buckets.index(key)]
        return self.block


def plan_units(spec: ModelSpec, layout: Layout) -> Units:
    """The units ``fs.shard`` builds for ``spec`` under ``layout`` (see the Note): with
    ``layout.tp > 1``, of one TP rank's share (``tensor_parallel.local_spec``)."""
    spec = local_spec(spec, layout.tp)
    v, c = spec.vocab * spec.hidden, spec.hidden
    head = () if spec.tied else (v,)
    if layout.split_root:
        root, tail = _unit(layout, "root", (v,)), _unit(layout, "tail", (c, *head))
    else:
        root, tail = _unit(layout, "root", (v, c, *head)), None
    block = _unit(layout, "block", tuple(spec.block_sizes))
    buckets = _buckets(block.pad * layout.precision.param, spec.layers, layout)
    # root_split.worth_lazy: big enough, and no TP (DTensor) parameter, whose saved DTensors
    # the lazy root could not rebuild after releasing it.
    big = root.numel * layout.precision.master >= LAZY_MIN_BYTES and layout.tp == 1
    lazy = tail is not None and big and layout.strategy in ("full_shard", "hybrid_shard")
    return Units(
        root=root,
        tail=tail,
        block=block,
        layers=spec.layers,
        buckets=buckets,
        bucket_units=tuple(_unit(layout, "bucket", block.sizes * len(b)) for b in buckets),
        lazy_root=lazy,
        root_regathered=lazy and spec.tied,
        # Units of TP parameters gather into buffers of their own (core/state.py).
        pooled=layout.strategy in ("full_shard", "hybrid_shard")
        and layout.tp == 1
        and (layout.shard_world > 1 or layout.precision.param != layout.precision.master),
    )


def _unit(layout: Layout, name: str, sizes: tuple[int, ...]) -> Unit:
    pad = layout.padded(sum(sizes))
    return Unit(name, sizes, pad, pad // layout.shard_world)


def _buckets(block_bytes: int, layers: int, layout: Layout) -> tuple[tuple[int, ...], ...]:
    """``engine.buckets.plan_buckets`` on the modules' order (root, tail, blocks): the root and
    the tail cut runs, so only the blocks, all of one size, can form buckets."""
    coalescible = layout.coalesce and layout.strategy != "no_shard" and layout.shard_world > 1
    if not coalescible or block_bytes > COALESCE.unit_bytes:
        return ()
    per_bucket = max(1, COALESCE.bucket_bytes // block_bytes)
    runs = [tuple(range(i, min(i + per_bucket, layers))) for i in range(0, layers, per_bucket)]
    return tuple(run for run in runs if len(run) > 1)
