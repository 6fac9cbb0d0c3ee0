"""Which units are gathered at each moment of a step: the engine's hooks, replayed on sizes.

[Note: the gather replay]
The estimate follows ``engine/hooks.py`` and ``engine/state.py`` unit by unit rather than
summing a formula per strategy, because the defaults interact: a bucket gathers all of its
sharded members when any of them is needed (or prefetched), prefetching counts a bucket as
one unit, the last block reshards after forward once the root's tail starts the backward,
the lazy root is released after forward, and blocks outside buckets under full_shard borrow
buffers from the gather pool, which keeps up to ``max(2, prefetch_forward + 1)`` free buffers
(counted as gathered, as flatshard counts them) until the end of the next forward.

Two step orders, as the engine records them on the first iteration: forward (tail, root,
blocks) and backward (root, tail, blocks in reverse; the lazy root is never prefetched). The
post-backward of the tail runs *last*, after the root's: its autograd node is created at the
first pre-forward of the step, and autograd runs ready nodes latest-created first, so the
head's and final norm's gradients wait through the whole backward. With
``Prefetch(backward="post")`` the unit finishing last (the tail, or the root without one)
prefetches the next in the backward order, the last block (its whole bucket), at the very end
of backward, to no use. The replay keeps both, as measured.

Per moment it reports ``gathered`` (full buffers, private and pooled) and ``gather_inputs``
(what a gather in flight holds besides them until someone waits for it: a bucket's
concatenated send buffer and its ``world`` rows of staging; a lone unit's low-precision copy
of its shard under mixed precision). The step is replayed twice: the second is the steady
state (the pool's free buffers carried over).
"""

from __future__ import annotations

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
    block i gather``, ``backward block i``, ``backward root``, ``backward tail``, ``end of
    backward``, ``optimizer step``."""
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


class _Replay:
    """The engine's gather state machine on byte counts (see the Note)."""

    def __init__(self, units: Units, layout: Layout) -> None:
        self.units, self.layout = units, layout
        p = layout.precision
        self.sharded = layout.shard_world > 1
        self.replicated = not self.sharded and p.param == p.master  # used in place
        self.reshards = layout.strategy in ("full_shard", "hybrid_shard")
        self.keep = max(2, layout.prefetch_forward + 1)
        tail = ["tail"] if units.tail else []
        blocks = list(range(units.layers))
        self.forward = self._next([*tail, "root", *blocks])
        self.backward = self._next(["root", *tail, *reversed(blocks)])
        self.state: dict[Key, str] = {k: "sharded" for k in ["root", *tail, *blocks]}
        self.private: set[Key] = set()  # allocated private full buffers
        self.pool_used: set[Key] = set()
        self.pool_free = 0
        self.works: dict[Key, int] = {}  # a gathering unit -> its work (shared by a bucket)
        self.in_flight: dict[int, int] = {}  # work -> bytes it holds until waited for
        self.issued = 0  # works so far (their ids)
        self.traffic = 0  # padded elements gathered
        self.moments: dict[str, Parts] = {}

    @staticmethod
    def _next(order: list[Key]) -> dict[Key, Key]:
        return dict(pairwise(order))

    # ---- sizes -------------------------------------------------------------------------------
    def unit(self, key: Key) -> Unit:
        return self.units.block if isinstance(key, int) else getattr(self.units, key)

    def full(self, key: Key) -> int:
        return 0 if self.replicated else self.unit(key).pad * self.layout.precision.param

    def pooled(self, key: Key) -> bool:
        """Borrows a pool buffer: a block that reshards after forward, in no bucket."""
        return isinstance(key, int) and self.reshards and self.bucket(key) is None

    def bucket(self, key: Key) -> tuple[int, ...] | None:
        return self.units.bucket_of(key) if isinstance(key, int) else None

    def snap(self, name: str) -> None:
        pooled = (len(self.pool_used) + self.pool_free) * self.full(0)
        held = sum(self.full(k) for k in self.private)
        self.moments[name] = {"gathered": held + pooled,
                              "gather_inputs": sum(self.in_flight.values())}  # fmt: skip

    # ---- the state machine (engine/unit.py, buckets.py, state.py, gather_pool.py) -----------
    def start(self, keys: list[Key]) -> None:
        """All-gather ``keys`` (sharded) in one collective."""
        p, world = self.layout.precision, self.layout.shard_world
        self.issued += 1
        self.traffic += sum(self.unit(k).pad for k in keys)
        for key in keys:
            if self.pooled(key):
                self.pool_free = max(0, self.pool_free - 1)  # else a new buffer
                self.pool_used.add(key)
            else:
                self.private.add(key)
            self.state[key] = "gathering"
            self.works[key] = self.issued
        shard = sum(self.full(k) for k in keys) // world
        if len(keys) > 1:  # a bucket: the concatenated shards, and world rows of staging
            self.in_flight[self.issued] = shard + world * shard
        elif self.sharded and p.param != p.master:  # the shard cast to the compute dtype
            self.in_flight[self.issued] = shard

    def wait(self, key: Key) -> None:
        if self.state[key] == "sharded":
            self.start([key])
        if self.state[key] == "gathering":
            self.in_flight.pop(self.works.pop(key), None)
            self.state[key] = "unsharded"

    def reshard(self, key: Key) -> None:
        if self.state[key] == "gathering":
            self.wait(key)
        if key in self.pool_used:
            self.pool_used.discard(key)
            self.pool_free = min(self.keep, self.pool_free + 1)
        self.private.discard(key)
        self.state[key] = "sharded"

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
            if key == "root" and order is self.backward and self.units.lazy_root:
                continue  # gathered in backward only on demand
            bucket = self.bucket(key)
            if bucket is None or bucket not in seen:
                out.append(key)
                seen.append(bucket)
        return out

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> None:
        self._forward()
        self._backward()
        for key in self.state:  # finish_backward: reshard_all
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
            # The last block stays gathered into the backward, unless the tail starts it.
            if self.reshards and not (i == last and units.tail is None):
                self.reshard(i)
            if i == last and self.reshards:
                self.pool_free = 0  # the pool is trimmed when the forward's last unit ends
        self.snap("loss")
        if units.lazy_root:
            self.reshard("root")

    def _pre_backward(self, key: Key) -> None:
        if key == "root" and self.units.lazy_root:
            return  # placeholders only (see lazy_root.py)
        self.gather_for_step(key, f"backward block {key} gather" if isinstance(key, int) else None)
        if self.layout.prefetch_backward == "pre":
            self.prefetch(self.ahead(self.backward, key, 1))

    def _post_backward(self, key: Key) -> None:
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
        for i in reversed(range(units.layers)):
            self._pre_backward(i)
            self.snap(f"backward block {i}")
            self._post_backward(i)
        for key in ["root", *(["tail"] if units.tail else [])]:  # the tail last: see the Note
            self.snap(f"backward {key}")
            self._post_backward(key)
        self.snap("end of backward")
