"""Which units are gathered at each moment of a step: the engine's hooks, replayed on sizes.

[Note: the gather replay]
The estimate follows ``engine/hooks.py``, ``state.py`` and ``buckets.py`` unit by unit rather
than summing a formula per strategy, because the defaults interact: a bucket gathers all of
its sharded members when any of them is needed (or prefetched) into one storage that lives
until its last member is released, prefetching counts a bucket as one unit, the last block
(with a tail: the last block's whole bucket) stays gathered into the backward, the lazy root
is released after forward, and under full_shard the gather pool lends buffers to the blocks
gathered alone and scratch buffers to the buckets (staging of a gather, the chunked gradient
of a reduction). The pool keeps up to ``max(2, prefetch_forward + 1)`` free buffers of each
dtype, best fit, until the end of the next forward; flatshard counts them as gathered, and so
does the replay. Released bucket storages stay allocated too, the first ``keep`` of them
(``engine/bucket_storage.py``, ``StorageCache``), until their bucket is gathered again.

Two step orders, as the engine records them on the first iteration: forward (tail, root,
blocks) and backward (root, tail, blocks in reverse; backward never prefetches the root units).
The post-backward of the tail runs right after the head's and final norm's backward, before
the blocks': the engine makes the tail's autograd node at the first use of its parameters,
behind the blocks' nodes, and autograd runs the ready node made last first.

Per moment it reports ``gathered`` (full buffers and the pool's) and ``gather_inputs`` (what a
gather in flight holds besides them until someone waits for it: a bucket's concatenated send
buffer, and its staging rows when there is no pool; a lone unit's low-precision copy of its
shard under mixed precision). The step is replayed twice: the second is the steady state (the
pool's free buffers carried over).
"""

from __future__ import annotations

from collections import deque
from itertools import pairwise

from .spec import Layout
from .units import Unit, Units

__all__ = ["gathered_per_step", "gathers"]

Key = int | str  # a block's index, "root" or "tail"
Parts = dict[str, int]


def gathers(units: Units, layout: Layout) -> dict[str, Parts]:
    """``{"gathered": ..., "gather_inputs": ...}`` bytes at every moment of a steady step:
    ``forward block i gather`` (its pre-forward, before the wait), ``forward block i``,
    ``loss``, ``loss backward``, ``head backward`` (the lazy root regathered), ``backward
    block i gather``, ``backward block i`` (its backward), ``backward block i end`` (its
    post-backward), ``backward root``, ``backward tail``, ``end of backward``, ``optimizer
    step``."""
    return _steady(units, layout).moments


def gathered_per_step(units: Units, layout: Layout) -> int:
    """Padded elements all-gathered in a steady step (every gather the replay starts)."""
    return _steady(units, layout).traffic


def _steady(units: Units, layout: Layout) -> _Replay:
    replay = _Replay(units, layout)
    replay.step()
    replay.moments.clear()
    replay.traffic = 0
    replay.step()
    return replay


class _Pool:
    """``engine/gather_pool.py`` on sizes: free buffers per kind (dtype), best fit within
    twice the request, at most ``keep`` free per kind (the smallest dropped)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.free: dict[str, list[int]] = {}
        self.used: dict[int, tuple[str, int]] = {}  # handle -> (kind, bytes)
        self.handles = 0

    def acquire(self, kind: str, nbytes: int) -> int:
        free = self.free.setdefault(kind, [])
        fits = [b for b in free if nbytes <= b <= 2 * nbytes]
        size = min(fits) if fits else nbytes
        if fits:
            free.remove(size)
        self.handles += 1
        self.used[self.handles] = (kind, size)
        return self.handles

    def release(self, handle: int) -> None:
        kind, size = self.used.pop(handle)
        free = self.free.setdefault(kind, [])
        free.append(size)
        if len(free) > self.keep:
            free.remove(min(free))

    def trim(self) -> None:
        self.free.clear()

    @property
    def nbytes(self) -> int:
        return sum(b for _, b in self.used.values()) + sum(map(sum, self.free.values()))


class _Replay:
    """The engine's gather state machine on byte counts (see the Note)."""

    def __init__(self, units: Units, layout: Layout) -> None:
        self.units, self.layout = units, layout
        p = layout.precision
        self.sharded = layout.shard_world > 1
        self.replicated = not self.sharded and p.param == p.master  # used in place
        self.reshards = layout.strategy in ("full_shard", "hybrid_shard")
        self.pool = _Pool(max(2, layout.prefetch_forward + 1)) if units.pooled else None
        self.kinds = (p.name, p.reduce or p.name)  # the compute and the reduce dtype
        tail = ["tail"] if units.tail else []
        blocks = list(range(units.layers))
        self.forward = dict(pairwise([*tail, "root", *blocks]))
        self.backward = dict(pairwise(["root", *tail, *reversed(blocks)]))
        self.state: dict[Key, str] = {k: "sharded" for k in ["root", *tail, *blocks]}
        self.private: set[Key] = set()  # holding their full buffer (a bucket's: shared)
        # buckets whose released storage the engine's StorageCache keeps (at most `keep`)
        self.cached: list[tuple[int, ...]] = []
        self.cache_keep = max(2, layout.prefetch_forward + 1)
        self.borrowed: dict[Key, int] = {}  # blocks in pool buffers -> their handle
        self.works: dict[Key, int] = {}  # a gathering unit -> its work (shared by a bucket)
        # work -> (its send buffer, its staging rows when not pooled, their pool handle)
        self.in_flight: dict[int, tuple[int, int, int | None]] = {}
        self.issued = 0  # works so far (their ids)
        self.reducing: deque[int | None] = deque()  # reductions in flight: chunked handles
        self.chunked: dict[tuple[int, ...], int] = {}  # bucket -> its chunked scratch
        self.traffic = 0  # padded elements gathered
        self.moments: dict[str, Parts] = {}

    # ---- sizes -------------------------------------------------------------------------------
    def unit(self, key: Key) -> Unit:
        return self.units.block if isinstance(key, int) else getattr(self.units, key)

    def full(self, key: Key) -> int:
        return 0 if self.replicated else self.unit(key).pad * self.layout.precision.param

    def bucket(self, key: Key) -> tuple[int, ...] | None:
        return self.units.bucket_of(key) if isinstance(key, int) else None

    def snap(self, name: str) -> None:
        held = {self.bucket(k) or (k,) for k in self.private}  # a bucket's storage once
        held |= set(self.cached)
        gathered = sum(self.full(k) for keys in held for k in keys)
        pooled = self.pool.nbytes if self.pool else 0
        inputs = sum(send + staging for send, staging, _ in self.in_flight.values())
        self.moments[name] = {"gathered": gathered + pooled, "gather_inputs": inputs}

    # ---- the state machine (engine/unit.py, buckets.py, state.py, gather_pool.py) -----------
    def start(self, keys: list[Key]) -> None:
        """All-gather ``keys`` (sharded) in one collective."""
        p, world = self.layout.precision, self.layout.shard_world
        self.issued += 1
        self.traffic += sum(self.unit(k).pad for k in keys)
        for key in keys:
            if self.pool is not None and isinstance(key, int) and self.bucket(key) is None:
                self.borrowed[key] = self.pool.acquire(self.kinds[0], self.full(key))
            else:
                self.private.add(key)
            self.state[key] = "gathering"
            self.works[key] = self.issued
            if self.bucket(key) in self.cached:  # its storage's memory is reused
                self.cached.remove(self.bucket(key))  # type: ignore[arg-type]
        shard = sum(self.full(k) for k in keys) // world
        if len(keys) > 1:  # a bucket: the concatenated shards, and world rows of staging
            pooled = self.pool.acquire(self.kinds[0], world * shard) if self.pool else None
            self.in_flight[self.issued] = (shard, 0 if pooled else world * shard, pooled)
        elif self.sharded and p.param != p.master:  # the shard cast to the compute dtype
            self.in_flight[self.issued] = (shard, 0, None)

    def wait(self, key: Key) -> None:
        if self.state[key] == "sharded":
            self.start([key])
        if self.state[key] == "gathering":
            _, _, staging = self.in_flight.pop(self.works.pop(key), (0, 0, None))
            if staging is not None:
                self.pool.release(staging)  # type: ignore[union-attr]
            self.state[key] = "unsharded"

    def reshard(self, key: Key) -> None:
        if self.state[key] == "gathering":
            self.wait(key)
        if key in self.borrowed:
            self.pool.release(self.borrowed.pop(key))  # type: ignore[union-attr]
        if key in self.private:
            self.private.discard(key)
            self._released(self.bucket(key))
        self.state[key] = "sharded"

    def _released(self, bucket: tuple[int, ...] | None) -> None:
        """A member let go: the bucket's storage, once no member holds it, stays in the
        engine's ``StorageCache`` while it has room (automatic buckets fit its size limit)."""
        if bucket is None or any(k in self.private for k in bucket):
            return
        if len(self.cached) < self.cache_keep:
            self.cached.append(bucket)

    def gather_for_step(self, key: Key, moment: str | None = None) -> None:
        """Gather ``key`` with its bucket and wait; ``moment``: the instant before the wait,
        when a gather issued here (not prefetched) holds its send and staging buffers."""
        self.prefetch([key])
        if moment is not None:
            self.snap(moment)
        self.wait(key)

    def prefetch(self, keys: list[Key]) -> None:
        for key in keys:
            if self.state[key] == "sharded":
                bucket = self.bucket(key)
                self.start([k for k in bucket or (key,) if self.state[k] == "sharded"])

    def ahead(self, order: dict[Key, Key], key: Key, count: int) -> list[Key]:
        """``ShardedState.ahead``: the next ``count`` units, a bucket counting as one."""
        out: list[Key] = []
        seen = [self.bucket(key)]
        while len(out) < count and (key := order.get(key)) is not None:  # type: ignore[assignment]
            if key in ("root", "tail") and order is self.backward:
                continue  # gathered at the backward's start already, or on demand (lazy)
            bucket = self.bucket(key)
            if bucket is None or bucket not in seen:
                out.append(key)
                seen.append(bucket)
        return out

    def reduce(self, key: Key, moment: str) -> None:
        """``key``'s post-backward hands its gradients over (a bucket's first member takes
        the chunked scratch, its last launches the reduction; anything else launches its
        own); ``moment`` is the launch, before the oldest beyond ``max_inflight_reduces`` is
        waited for (which returns its chunked scratch to the pool)."""
        bucket = self.bucket(key)
        if bucket is not None and key == bucket[-1] and self.pool is not None:
            nbytes = len(bucket) * self.unit(key).pad * self.layout.precision.flat
            self.chunked[bucket] = self.pool.acquire(self.kinds[1], nbytes)
        launches = bucket is None or key == bucket[0]
        if launches:
            self.reducing.append(self.chunked.pop(bucket, None) if bucket else None)
        self.snap(moment)
        while launches and len(self.reducing) > self.layout.max_inflight_reduces:
            self._reduced(self.reducing.popleft())

    def _reduced(self, chunked: int | None) -> None:
        if chunked is not None:
            self.pool.release(chunked)  # type: ignore[union-attr]

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> None:
        self._forward()
        self._backward()
        while self.reducing:  # finish_backward: wait for every reduction, reshard_all
            self._reduced(self.reducing.popleft())
        for key in self.state:
            if self.state[key] != "sharded":
                self.reshard(key)
        self.snap("optimizer step")

    def _pre_forward(self, key: Key) -> None:
        self.gather_for_step(key, f"forward block {key} gather" if isinstance(key, int) else None)
        self.prefetch(self.ahead(self.forward, key, self.layout.prefetch_forward))

    def _forward(self) -> None:
        units, last = self.units, self.units.layers - 1
        if units.tail:
            self._pre_forward("tail")
        self._pre_forward("root")
        for i in range(units.layers):
            self._pre_forward(i)
            self.snap(f"forward block {i}")
            # The last block stays gathered into the backward, where it comes first, unless
            # the tail starts the backward; the last block's bucket always stays whole.
            bucket = self.bucket(i)
            kept = (i == last and units.tail is None) or (bucket and bucket == self.bucket(last))
            if self.reshards and not kept:
                self.reshard(i)
            if i == last and self.pool is not None:
                self.pool.trim()  # when the forward's last unit ends
        self.snap("loss")
        if units.lazy_root:
            self.reshard("root")

    def _pre_backward(self, key: Key) -> None:
        if key == "root" and self.units.lazy_root:
            return  # placeholders only (see lazy_root.py)
        self.gather_for_step(key, f"backward block {key} gather" if isinstance(key, int) else None)
        if self.layout.prefetch_backward == "pre":
            self.prefetch(self.ahead(self.backward, key, 1))

    def _post_backward(self, key: Key, moment: str) -> None:
        self.reduce(key, moment)
        self.reshard(key)
        if self.layout.prefetch_backward == "post":
            self.prefetch(self.ahead(self.backward, key, 1))

    def _backward(self) -> None:
        units = self.units
        for key in ["root", *(["tail"] if units.tail else [])]:
            self._pre_backward(key)
        self.snap("loss backward")
        if units.root_regathered:  # lm_head's backward unpacks the tied weight
            self.gather_for_step("root")
            self.snap("head backward")
        if units.tail:  # its node is made behind the blocks': it runs first (see the Note)
            self._post_backward("tail", "backward tail")
        for i in reversed(range(units.layers)):
            self._pre_backward(i)
            self.snap(f"backward block {i}")
            self._post_backward(i, f"backward block {i} end")
        self._post_backward("root", "backward root")
        self.snap("end of backward")
