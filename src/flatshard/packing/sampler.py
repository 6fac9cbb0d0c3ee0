"""Deal packed bins to data-parallel ranks: equal micro-batch counts, balanced cost, resumable.

[Note: the global order and why resume survives a new world size]
Each epoch has one *global* sequence of bins that depends only on (lengths, capacity, algorithm,
seed, epoch) -- never on rank or world size. A step takes the next
``world_size * micro_batches * bins_per_micro_batch`` bins of that sequence and deals them to
ranks. The resume position is just ``bins_consumed``, a count in the global sequence, so a run
restarted at another world size continues with the very next bin: nothing is repeated, nothing
skipped.

[Note: equal micro-batch counts]
FSDP runs collectives in every forward/backward, so a rank that runs one micro-batch fewer
than the others hangs them. Every rank therefore gets exactly ``micro_batches`` micro-batches per
step. In the final, partial step of an epoch every rank gets ``ceil(remaining / (world_size *
bins_per_micro_batch))`` micro-batches and some may be empty lists: collate them anyway (all
padding, zero targets) and run forward/backward so the collectives stay in lockstep -- or pass
``drop_last=True`` to skip that step.

[Note: balance]
Within a step, bins are dealt longest-processing-time first: heaviest bin to the currently
lightest rank that still has a free slot. A bin's cost is ``token_cost * tokens + pair_cost *
sum(len^2)``: linear layers cost ~24*d^2 flops per token per layer, attention ~2*d per token
pair per layer, so ``pair_cost / token_cost ~ 1 / (12 * d_model)`` (the default 1e-4 suits
d_model ~ 768). ``StepPlan.imbalance`` reports max/mean - 1 of the rank costs.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from flatshard.packing.binpack import _as_int_list, pack, split_long_documents


@dataclass(frozen=True)
class StepPlan:
    """One step dealt to all ranks (every rank computes the same plan)."""

    start: int
    """Global bin offset of the step's first bin."""
    end: int
    """Global bin offset after the step (the next step's ``start``)."""
    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    """``micro_batches[rank][i]``: document indices of micro-batch ``i`` of ``rank``."""
    rank_costs: tuple[float, ...]
    """Estimated cost per rank."""

    @property
    def imbalance(self) -> float:
        """``max(rank_costs) / mean(rank_costs) - 1`` (0 = perfect balance)."""
        mean = sum(self.rank_costs) / len(self.rank_costs)
        return max(self.rank_costs) / mean - 1.0 if mean > 0 else 0.0


def _positive_int(value: Any, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")
    return value


def _deal(costs: list[float], ranks: int, slots: int) -> tuple[list[list[int]], list[float]]:
    """LPT with a cardinality cap: positions of ``costs`` per rank, and the rank totals."""
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    heap = [(0.0, r) for r in range(ranks)]
    dealt: list[list[int]] = [[] for _ in range(ranks)]
    totals = [0.0] * ranks
    for i in order:
        total, r = heapq.heappop(heap)
        dealt[r].append(i)
        totals[r] = total + costs[i]
        if len(dealt[r]) < slots:
            heapq.heappush(heap, (totals[r], r))
    return dealt, totals


class PackedBatchSampler:
    """Yields, per step, this rank's micro-batches (lists of document indices).

    Args:
        lengths: token count of every document (with ``split_long=True``: indices refer to
            ``split_long_documents(lengths, capacity)``, as in :func:`pack`).
        capacity: tokens per bin (= ``seq_len`` of :func:`collate`).
        rank, world_size: this rank and the number of data-parallel ranks (no global state).
        micro_batches: micro-batches per rank per step (gradient accumulation steps).
        bins_per_micro_batch: bins per micro-batch; collate a micro-batch with
            ``collate(docs, capacity, pad_id=..., rows=bins_per_micro_batch)``.
        seed, shuffle: the bin order of an epoch is shuffled with ``(seed, epoch)``.
        algorithm: packing algorithm (see :func:`pack`); ``"shuffle_ff"`` regroups documents
            every epoch, the others pack the same bins each epoch in a new order.
        drop_last: skip the final partial step of an epoch instead of padding it.
        token_cost, pair_cost: cost model ``token_cost * tokens + pair_cost * sum(len^2)``.

    Iterate once per epoch (call :meth:`set_epoch` like ``DistributedSampler``); each item is
    a list of ``micro_batches`` micro-batches. ``state_dict()`` after a step resumes after it.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        capacity: int,
        *,
        rank: int,
        world_size: int,
        micro_batches: int = 1,
        bins_per_micro_batch: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        algorithm: str = "bfd",
        split_long: bool = False,
        drop_last: bool = False,
        token_cost: float = 1.0,
        pair_cost: float = 1e-4,
    ) -> None:
        self.world_size = _positive_int(world_size, "world_size")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank!r} must be an int in [0, world_size={world_size})")
        self.rank = rank
        self.micro_batches = _positive_int(micro_batches, "micro_batches")
        self.bins_per_micro_batch = _positive_int(bins_per_micro_batch, "bins_per_micro_batch")
        self._lengths = _as_int_list(lengths)
        self.capacity, self.seed, self.shuffle = capacity, seed, shuffle
        self.algorithm, self.split_long, self.drop_last = algorithm, split_long, drop_last
        self.token_cost, self.pair_cost = token_cost, pair_cost
        self.epoch = 0
        self.bins_consumed = 0
        self.last_plan: StepPlan | None = None
        self._cache: tuple[int, list[list[int]], list[float]] | None = None
        self._pack(0)  # validate lengths/capacity/algorithm now, not at the first step

    def _pack(self, epoch: int) -> tuple[list[list[int]], list[float]]:
        """The epoch's global bin order and per-bin costs (cached for the current epoch)."""
        if self._cache is None or self._cache[0] != epoch:
            # only shuffle_ff takes a seed: it regroups documents every epoch
            seed = self.seed * 1_000_003 + epoch if self.algorithm == "shuffle_ff" else 0
            bins = pack(
                self._lengths,
                self.capacity,
                algorithm=self.algorithm,
                split_long=self.split_long,
                seed=seed,
            )
            if self.shuffle:
                random.Random(f"{self.seed}:{epoch}").shuffle(bins)
            lens = self._item_lengths()
            costs = [
                self.token_cost * sum(lens[i] for i in b)
                + self.pair_cost * sum(lens[i] ** 2 for i in b)
                for b in bins
            ]
            self._cache = (epoch, bins, costs)
        return self._cache[1], self._cache[2]

    def _item_lengths(self) -> list[int]:
        if not self.split_long:
            return self._lengths
        return [c.length for c in split_long_documents(self._lengths, self.capacity)]

    @property
    def num_bins(self) -> int:
        """Bins in the current epoch."""
        return len(self._pack(self.epoch)[0])

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; a *different* epoch restarts at its first bin (resume keeps it)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.bins_consumed = 0

    def plan(self, start: int | None = None) -> StepPlan | None:
        """The step starting at global bin ``start`` (default: the next one); None at the end."""
        bins, costs = self._pack(self.epoch)
        start = self.bins_consumed if start is None else start
        per_rank = self.micro_batches * self.bins_per_micro_batch
        remaining = len(bins) - start
        if remaining <= 0 or (self.drop_last and remaining < per_rank * self.world_size):
            return None
        if remaining >= per_rank * self.world_size:
            count = self.micro_batches
        else:  # final partial step: fewer micro-batches, same number on every rank
            count = -(-remaining // (self.world_size * self.bins_per_micro_batch))
        end = min(len(bins), start + per_rank * self.world_size)
        dealt, totals = _deal(costs[start:end], self.world_size, count * self.bins_per_micro_batch)
        micro = tuple(self._group(bins, start, mine, count) for mine in dealt)
        return StepPlan(start=start, end=end, micro_batches=micro, rank_costs=tuple(totals))

    def _group(self, bins: list[list[int]], start: int, mine: list[int], count: int) -> tuple:
        """Split one rank's dealt bins into ``count`` micro-batches of flat document indices."""
        k = self.bins_per_micro_batch
        mine = sorted(mine)  # keep global order inside the rank
        return tuple(
            tuple(doc for pos in mine[j * k : (j + 1) * k] for doc in bins[start + pos])
            for j in range(count)
        )

    def __iter__(self) -> Iterator[list[list[int]]]:
        while (step := self.plan()) is not None:
            self.bins_consumed = step.end
            self.last_plan = step
            yield [list(mb) for mb in step.micro_batches[self.rank]]

    def __len__(self) -> int:
        """Steps left in the current epoch at this world size."""
        per_step = self.world_size * self.micro_batches * self.bins_per_micro_batch
        remaining = max(0, self.num_bins - self.bins_consumed)
        return remaining // per_step if self.drop_last else -(-remaining // per_step)

    def state_dict(self) -> dict[str, int | str]:
        """World-size independent position: epoch and bins consumed in the global order."""
        return {
            "epoch": self.epoch,
            "bins_consumed": self.bins_consumed,
            "seed": self.seed,
            "num_documents": len(self._lengths),
            "capacity": self.capacity,
            "algorithm": self.algorithm,
            "world_size": self.world_size,  # informational: any world size may resume
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state`` (any world size/rank); the data set must be the same."""
        for key in ("seed", "num_documents", "capacity", "algorithm"):
            mine = self.state_dict()[key]
            if state.get(key) != mine:
                raise ValueError(
                    f"cannot resume: saved {key}={state.get(key)!r} but this sampler has "
                    f"{key}={mine!r}; build the sampler with the saved settings and data"
                )
        self.epoch = int(state["epoch"])
        self.bins_consumed = int(state["bins_consumed"])
