"""Search structures behind the bin packers (internal).

[Note: why two structures]
Best fit asks "which open bin has the *smallest* free space that is still >= s?" -- a
successor query over the multiset of free-space values, answered by :class:`SortedKeys`
(a bucketed sorted list: bisect over bucket maxima, then inside one short bucket).
First fit asks "which is the *lowest-numbered* bin with free space >= s?" -- a leftmost
descent in a max segment tree over bins, :class:`MaxTree`. Both cost O(log n) Python-level
steps per item (plus a memmove of at most ``2 * load`` machine words for SortedKeys), which
is what lets 200k lengths pack in well under a second or two in pure Python.
"""

from __future__ import annotations

from bisect import bisect_left, insort


class SortedKeys:
    """A sorted multiset of ints with ``add`` and ``pop_ceiling`` (remove the smallest >= key).

    Keys live in buckets of at most ``2 * load`` sorted ints; ``_maxes[i]`` is the largest key of
    bucket ``i``, so a query is two bisections and a list ``pop``.
    """

    def __init__(self, load: int = 256) -> None:
        self._load = load
        self._lists: list[list[int]] = []
        self._maxes: list[int] = []

    def __len__(self) -> int:
        return sum(len(sub) for sub in self._lists)

    def add(self, key: int) -> None:
        """Insert ``key``."""
        maxes = self._maxes
        if not maxes:
            self._lists.append([key])
            maxes.append(key)
            return
        i = bisect_left(maxes, key)
        if i == len(maxes):
            i -= 1
            self._lists[i].append(key)
            maxes[i] = key
        else:
            insort(self._lists[i], key)
        if len(self._lists[i]) > 2 * self._load:
            self._split(i)

    def _split(self, i: int) -> None:
        sub = self._lists[i]
        head, tail = sub[: self._load], sub[self._load :]
        self._lists[i : i + 1] = [head, tail]
        self._maxes[i : i + 1] = [head[-1], tail[-1]]

    def pop_ceiling(self, key: int) -> int | None:
        """Remove and return the smallest stored key >= ``key``; ``None`` if there is none."""
        maxes = self._maxes
        i = bisect_left(maxes, key)
        if i == len(maxes):
            return None
        sub = self._lists[i]
        j = bisect_left(sub, key)
        found = sub.pop(j)
        if not sub:
            del self._lists[i]
            del maxes[i]
        elif j == len(sub):
            maxes[i] = sub[-1]
        return found


class MaxTree:
    """Max segment tree over ``n`` bins' free space, every bin starting with ``capacity`` free.

    Unopened bins are simply leaves still at ``capacity``, so "open a new bin" is just the
    leftmost descent landing on a fresh leaf.
    """

    def __init__(self, n: int, capacity: int) -> None:
        size = 1
        while size < max(n, 1):
            size *= 2
        self._size = size
        self._tree = [capacity] * (2 * size)

    def first_fit(self, need: int) -> int:
        """Take ``need`` from the lowest-numbered bin with that much room; return its index."""
        tree = self._tree
        if tree[1] < need:
            raise AssertionError("MaxTree sized too small: no bin has enough free space")
        i, size = 1, self._size
        while i < size:
            i *= 2
            if tree[i] < need:
                i += 1
        tree[i] -= need
        leaf = i - size
        i //= 2
        while i:
            best = max(tree[2 * i], tree[2 * i + 1])
            if tree[i] == best:
                break
            tree[i] = best
            i //= 2
        return leaf
