"""The last collectives flatshard issued off Gloo, host-side only, for a hang's post-mortem.

[Note: the collective log]
Why: under NCCL a hang is ended by the process group's own watchdog (after its timeout,
``init_process_group(timeout=)``, 10 min by default), and torch's flight recorder
(``TORCH_NCCL_TRACE_BUFFER_SIZE``, ``TORCH_NCCL_DUMP_ON_TIMEOUT``) names the stuck
collective by its group, sequence number, op and sizes. Neither knows which flatshard unit or
bucket issued it. Finding out from Python must not cost the host: querying a CUDA work
(``work.is_completed()``, a ``cudaEventQuery``) from a Python thread takes the GIL from the
training loop and duplicates what the group's watchdog already does every 100 ms.

How: each collective flatshard issues off Gloo appends one ``Record`` (the group's ranks are
read later, only when printed; torch's per-group sequence number when readable, the op,
flatshard's label, the host issue time) to a bounded ring (``deque(maxlen=)``: the append is
atomic under the GIL and O(1); nothing ever reads the work). The ring holds the work's group,
never the work nor its tensors. ``FLATSHARD_COLLECTIVE_LOG`` sizes it (default 256; 0 turns
it off); ``FLATSHARD_WATCHDOG=off`` also turns it off.

Reaching it: torch 2.13 offers Python no hook on the watchdog's timeout (its dump hooks are
C++ only; with ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` at its default the process is torn down
from C++, where no Python code runs). So the ring is read on demand: :func:`dump` (from a
debugger attached to the hung process, a signal handler the user installs, or a test)
returns "the last collectives each unit issued", newest last, each with the sequence number
that the flight recorder's dump shows for the same collective, and says whether that dump is
on. docs/reliability.md, "When a rank hangs under NCCL", says which variables to set.
"""

from __future__ import annotations

import os
import time
from collections import deque

DEFAULT_SIZE = 256
PER_LABEL = 3  # how many of each unit's last collectives the dump shows


class Record:
    """One collective as issued (``__slots__``: the append stays cheap)."""

    __slots__ = ("group", "issued", "label", "op", "seq")

    def __init__(self, group, seq: int | None, op: str, label: str, issued: float) -> None:
        self.group, self.seq, self.op, self.label, self.issued = group, seq, op, label, issued


def _env_size() -> int:
    try:
        return max(int(os.environ.get("FLATSHARD_COLLECTIVE_LOG", "") or DEFAULT_SIZE), 0)
    except ValueError:
        return DEFAULT_SIZE


_RING: deque[Record] = deque(maxlen=_env_size())


def resize(size: int) -> None:
    """A ring of ``size`` records (0: record nothing), emptied; for tests and programs."""
    global _RING
    _RING = deque(maxlen=max(size, 0))


def record(op: str, label: str = "", group=None, clock=time.monotonic) -> None:
    """Append one collective just issued (O(1); the oldest falls out of a full ring)."""
    if _RING.maxlen:
        _RING.append(Record(group, _sequence(group), op, label, clock()))


def records() -> list[Record]:
    return list(_RING)


def _sequence(group) -> int | None:
    """torch's sequence number of ``group`` after this collective (NCCL's ``seqCollective_``,
    the flight recorder's ``collective_seq_id``); None where the backend keeps none."""
    try:
        import torch.distributed as dist

        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        return int(pg._get_sequence_number_for_group())
    except Exception:  # a private accessor: its absence must not break a collective
        return None


def dump(now: float | None = None, flight_recorder: bool = False) -> str:
    """The last ``PER_LABEL`` collectives each unit (label) issued, oldest unit first, with
    their age; ``flight_recorder=True`` also says whether torch's flight recorder is on and
    where its dump goes (``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``)."""
    now = time.monotonic() if now is None else now
    rows = list(_RING)
    by_label: dict[str, list[Record]] = {}
    for r in rows:
        by_label.setdefault(r.label or "(no label)", []).append(r)
    rank = _rank()
    lines = [f"[flatshard rank {rank}] the last collectives each unit issued ({len(rows)} in "
             "the log, newest last; seq: the flight recorder's collective_seq_id):"]  # fmt: skip
    for label, mine in sorted(by_label.items(), key=lambda kv: kv[1][-1].issued):
        for r in mine[-PER_LABEL:]:
            seq = "?" if r.seq is None else r.seq
            lines.append(f"  {label}: {r.op} seq {seq} over ranks {_ranks(r.group)}, "
                         f"issued {now - r.issued:.1f} s ago")  # fmt: skip
    if not rows:
        lines.append("  (none recorded: Gloo, FLATSHARD_COLLECTIVE_LOG=0 or WATCHDOG=off)")
    if flight_recorder:
        lines.append(f"  torch's flight recorder: {_dump_flight_recorder()}")
    return "\n".join(lines)


def _rank() -> int | str:
    try:
        import torch.distributed as dist

        # world: the dump names the process (global rank), as torch's flight recorder does
        return dist.get_rank() if dist.is_initialized() else 0  # world: see above
    except RuntimeError:
        return "?"


def _ranks(group) -> str:
    try:
        import torch.distributed as dist

        default = dist.group.WORLD  # world: a collective issued with group=None ran there
        return str(dist.get_process_group_ranks(group if group is not None else default))
    except Exception:  # a destroyed group: the dump must still go out
        return "?"


def _dump_flight_recorder() -> str:
    """Where torch writes its flight recorder's dump; flatshard does not trigger it (torch
    writes it on the watchdog's timeout, ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``)."""
    if not (
        os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")
    ):
        return "off (set TORCH_FR_BUFFER_SIZE, formerly TORCH_NCCL_TRACE_BUFFER_SIZE, e.g. 2000)"
    prefix = os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "torch's default prefix ")
    return f"on; written on timeout to {prefix}<rank> (TORCH_NCCL_DUMP_ON_TIMEOUT=1)"
