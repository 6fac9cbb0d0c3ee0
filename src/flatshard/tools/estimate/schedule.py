"""Which units are gathered at each moment of a step: the engine's hooks, replayed on sizes.

[Note: the gather replay]
The estimate follows ``core/hooks.py``, ``state.py`` and ``buckets.py`` unit by unit rather
than summing a formula per strategy, because the defaults interact: a bucket is one unit over
its blocks, gathered at its first block's forward and released after its last block's (its
backward: gathered at its last block's, released after its first block's), prefetching
counts it as one unit, the last block (with a tail: the last bucket) stays gathered into the
backward, the lazy root is released after forward, and under full_shard the gather pool lends
buffers to the blocks gathered alone (a bucket's buffer is its own). The pool keeps up to
``max(2, prefetch_forward + 1)`` free
buffers of each dtype, best fit, until the end of the next forward; flatshard counts them as
gathered, and so does the replay.

Two step orders, as the engine records them on the first iteration: forward (tail, root,
blocks) and backward (root, tail, blocks in reverse; backward never prefetches the root units).
The post-backward of the tail runs right after the head's and final norm's backward, before
the blocks': the engine makes the tail's autograd node at the first use of its parameters,
behind the blocks' nodes, and autograd runs the ready node made last first.

Per moment it reports ``gathered`` (full buffers and the pool's) and ``gather_inputs`` (what a
gather in flight holds besides them until someone waits for it: a unit's low-precision copy of
its shard under mixed precision). The step is replayed twice: the second is the steady state (the
pool's free buffers carried over).
"""

from __future__ import annotations

from itertools import pairwise

from flatshard.tools.estimate.spec import Layout
from flatshard.tools.estimate.units import Unit, Units

__all__ = ["gathered_per_step", "gathers"]

Key = int | str | tuple[int, ...]  # a block's index, a bucket's, "root" or "tail"
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
    """``features/gather_pool.py`` on sizes: free buffers per kind (dtype), best fit within
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
        blocks = list(dict.fromkeys(self.key(i) for i in range(units.layers)))  # units, in order
        self.forward = dict(pairwise([*tail, "root", *blocks]))
        self.backward = dict(pairwise(["root", *tail, *reversed(blocks)]))
        self.state: dict[Key, str] = {k: "sharded" for k in ["root", *tail, *blocks]}
        self.private: set[Key] = set()  # holding their full buffer
        self.borrowed: dict[Key, int] = {}  # units in pool buffers -> their handle
        self.works: dict[Key, int] = {}  # a gathering unit -> its work
        self.in_flight: dict[int, int] = {}  # work -> its cast send buffer (mixed precision)
        self.issued = 0  # works so far (their ids)
        self.reducing = 0  # reductions in flight (they hold no gathered memory)
        self.traffic = 0  # padded elements gathered
        self.moments: dict[str, Parts] = {}

    # ---- sizes -------------------------------------------------------------------------------
    def key(self, block: int) -> Key:
        """The unit block ``block`` belongs to: itself, or its bucket."""
        return self.units.bucket_of(block) or block

    def unit(self, key: Key) -> Unit:
        return self.units.unit_of(key) if not isinstance(key, str) else getattr(self.units, key)

    def full(self, key: Key) -> int:
        return 0 if self.replicated else self.unit(key).pad * self.layout.precision.param

    def snap(self, name: str) -> None:
        gathered = sum(self.full(k) for k in self.private)
        pooled = self.pool.nbytes if self.pool else 0
        inputs = sum(self.in_flight.values())
        self.moments[name] = {"gathered": gathered + pooled, "gather_inputs": inputs}

    # ---- the state machine (core/unit.py, state.py, gather_pool.py) -----------------------
    def start(self, key: Key) -> None:
        """All-gather ``key`` (sharded)."""
        p, world = self.layout.precision, self.layout.shard_world
        self.issued += 1
        self.traffic += self.unit(key).pad
        if self.pool is not None and isinstance(key, int):  # a bucket's buffer is private
            self.borrowed[key] = self.pool.acquire(self.kinds[0], self.full(key))
        else:
            self.private.add(key)
        self.state[key] = "gathering"
        self.works[key] = self.issued
        if self.sharded and p.param != p.master:  # the shard cast to the compute dtype
            self.in_flight[self.issued] = self.full(key) // world

    def wait(self, key: Key) -> None:
        if self.state[key] == "sharded":
            self.start(key)
        if self.state[key] == "gathering":
            self.in_flight.pop(self.works.pop(key), 0)
            self.state[key] = "unsharded"

    def reshard(self, key: Key) -> None:
        if self.state[key] == "gathering":
            self.wait(key)
        if key in self.borrowed:
            self.pool.release(self.borrowed.pop(key))  # type: ignore[union-attr]
        self.private.discard(key)
        self.state[key] = "sharded"

    def gather_for_step(self, key: Key, moment: str | None = None) -> None:
        """Gather ``key`` and wait; ``moment``: the instant before the wait, when a gather
        issued here (not prefetched) holds its send buffer."""
        self.prefetch([key])
        if moment is not None:
            self.snap(moment)
        self.wait(key)

    def prefetch(self, keys: list[Key]) -> None:
        for key in keys:
            if self.state[key] == "sharded":
                self.start(key)

    def ahead(self, order: dict[Key, Key], key: Key, count: int) -> list[Key]:
        """``ShardedState.ahead``: the next ``count`` units."""
        out: list[Key] = []
        while len(out) < count and (key := order.get(key)) is not None:  # type: ignore[assignment]
            if key in ("root", "tail") and order is self.backward:
                continue  # gathered at the backward's start already, or on demand (lazy)
            out.append(key)
        return out

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> None:
        self._forward()
        self._backward()
        for key in self.state:  # finish_backward: wait for every reduction, reshard_all
            if self.state[key] != "sharded":
                self.reshard(key)
        self.snap("optimizer step")

    def _pre_forward(self, key: Key, moment: str | None) -> None:
        self.gather_for_step(key, moment)
        self.prefetch(self.ahead(self.forward, key, self.layout.prefetch_forward))

    def _forward(self) -> None:
        units, last = self.units, self.key(self.units.layers - 1)
        if units.tail:
            self._pre_forward("tail", None)
        self._pre_forward("root", None)
        for i in range(units.layers):
            key = self.key(i)
            if not isinstance(key, tuple) or i == key[0]:  # a bucket: at its first block
                self._pre_forward(key, f"forward block {i} gather")
            else:
                self.snap(f"forward block {i} gather")
            self.snap(f"forward block {i}")
            if isinstance(key, tuple) and i != key[-1]:
                continue  # a bucket is released once its last block ran
            # The last unit stays gathered into the backward, where it comes first, unless
            # the tail starts the backward; a last bucket always stays.
            kept = key == last and (units.tail is None or isinstance(key, tuple))
            if self.reshards and not kept:
                self.reshard(key)
            if key == last and self.pool is not None:
                self.pool.trim()  # when the forward's last unit ends
        self.snap("loss")
        if units.lazy_root:
            self.reshard("root")

    def _pre_backward(self, key: Key, moment: str | None = None) -> None:
        if key == "root" and self.units.lazy_root:
            return  # placeholders only (see lazy_root.py)
        self.gather_for_step(key, moment)
        if self.layout.prefetch_backward == "pre":
            self.prefetch(self.ahead(self.backward, key, 1))

    def _post_backward(self, key: Key, moment: str) -> None:
        self.snap(moment)  # the reduction is launched (it holds no gathered memory)
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
            key = self.key(i)
            if not isinstance(key, tuple) or i == key[-1]:  # a bucket: at its last block
                self._pre_backward(key, f"backward block {i} gather")
            else:
                self.snap(f"backward block {i} gather")
            self.snap(f"backward block {i}")
            if not isinstance(key, tuple) or i == key[0]:  # its node runs after the first's
                self._post_backward(key, f"backward block {i} end")
            else:
                self.snap(f"backward block {i} end")
        self._post_backward("root", "backward root")
        self.snap("end of backward")
