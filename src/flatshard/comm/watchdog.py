"""A per-process thread that names a collective stuck in flight, without blocking the host.

[Note: the collective watchdog]
Why: on Gloo every flatshard wait passes ``FLATSHARD_TIMEOUT_S`` and blocks the host, so a
hang becomes an error naming the rank and the operation; nothing here runs. On NCCL (any
backend but Gloo) a wait must not take a timeout: ProcessGroupNCCL's ``wait(timeout)`` makes
the host poll until the collective has completed on the GPU, which ends all CPU run-ahead
(see ``collectives._bounded_wait``). A hang there is torch's to end: the process group's own
watchdog thread (``init_process_group(timeout=)``, 10 min by default) aborts the group, and its
flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``, ``TORCH_NCCL_DUMP_ON_TIMEOUT``) dumps the
collectives in flight. flatshard adds only what they lack: which unit issued the collective.

How, on a device backend (``watch``, from ``PendingWork``'s construction): one record in the
collective log (``collective_log.py``, [Note: the collective log]): the group, torch's
sequence number, the op, flatshard's label, the issue time. O(1), host-side; no thread starts
and no Python code ever queries a CUDA work (``work.is_completed()`` is a ``cudaEventQuery``
that the group's watchdog makes anyway, every 100 ms). ``collective_log.dump()`` prints the
last collectives each unit issued; their sequence numbers match the flight recorder's dump.
``FLATSHARD_WATCHDOG=off`` records nothing; the other actions only matter to a polling
watchdog (below).

The polling watchdog, opt-in (``configure``: tests and programs that choose it in code), and
never on NCCL groups: a daemon thread wakes every ``interval_s``, forgets the completed works
and reports the oldest one in flight past its bound (one message to stderr and ``logging``,
naming the rank, the op, the label, the group's ranks, the age and what to check). Then, per
action: ``raise`` (default) also raises ``CollectiveHang`` at the main thread's next flatshard
wait; ``abort`` also aborts the group (``ProcessGroup.abort``); ``report`` only reports. It
serves backends whose works are host objects (the ``strict_async`` test backend, a process
group written in Python), where the query costs no device synchronization.

The bound (:func:`bound_s`): ``min(flatshard's timeout, T - max(0.2 T, 2 intervals))``, T the
group's timeout when readable (``_get_backend(dev).options._timeout``: NCCL and Gloo; a
Python process group's ``_timeout``; else torch's default for the backend): flatshard's message
comes at least 20% of T before the group's own. The timeout is also taken from every wait
(the engine passes its own to each ``PendingWork.wait``). The thread holds each ``Work`` (and
so its tensors) until the first poll after it completed.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

import torch.distributed as dist

from flatshard.comm import collective_log

log = logging.getLogger("flatshard.watchdog")

ACTIONS = ("raise", "abort", "report", "off")
DEFAULT_INTERVAL_S = 0.5
DEFAULT_TIMEOUT_S = 600.0  # FLATSHARD_TIMEOUT_S's default
GROUP_MARGIN = 0.2  # report at the latest at 80% of the group's timeout
THREAD_NAME = "flatshard-watchdog"


class CollectiveHang(RuntimeError):
    """Raised in the main thread, at its next flatshard wait, after the watchdog reported a
    collective stuck in flight (``FLATSHARD_WATCHDOG=raise`` or ``abort``)."""


class Entry:
    """One collective in flight, as registered (``__slots__``: registration stays cheap)."""

    __slots__ = ("group", "group_s", "issued", "label", "op", "reported", "work")

    def __init__(self, work, op: str, label: str, group, issued: float) -> None:
        self.work, self.op, self.label, self.group, self.issued = work, op, label, group, issued
        self.group_s: float | None = None  # the group's timeout, read by the thread once
        self.reported = False


def bound_s(flatshard_s: float, group_s: float | None, interval_s: float) -> float:
    """How long a collective may stay in flight before it is reported: flatshard's timeout,
    but at least ``max(20%, two polls)`` before the group's own timeout (see the Note)."""
    if group_s is None:
        return flatshard_s
    margin = max(GROUP_MARGIN * group_s, 2 * interval_s)
    return max(min(flatshard_s, group_s - margin), interval_s)


def group_timeout_s(group) -> float | None:
    """The timeout of ``group``'s own watchdog in seconds (None: the default group), the
    smallest over its device backends; None when it cannot be read."""
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
    except (RuntimeError, ValueError):
        return None
    found = []
    for device in getattr(pg, "_device_types", ()):
        try:  # NCCL and Gloo keep it in their options
            found.append(pg._get_backend(device).options._timeout.total_seconds())
        except (RuntimeError, AttributeError):
            continue
    if found:
        return min(found)
    own = getattr(pg, "_timeout", None)  # a process group written in Python (strict_async)
    if isinstance(own, datetime.timedelta):
        return own.total_seconds()
    try:  # torch's default for the backend: what the group got if nobody passed a timeout
        default = dist.distributed_c10d._get_default_timeout(dist.get_backend(pg))
        return default.total_seconds()
    except Exception:  # a private helper: its absence must not break the report
        return None


class Watchdog:
    """The collectives in flight of one process, and the thread that watches them.

    ``clock`` and ``poll(now)`` let tests drive it without the thread or real time."""

    def __init__(
        self,
        *,
        action: str = "raise",
        interval_s: float = DEFAULT_INTERVAL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if action not in ACTIONS:
            raise ValueError(f"FLATSHARD_WATCHDOG={action!r}: use one of {', '.join(ACTIONS)}")
        self.action, self.interval_s, self.timeout_s = action, interval_s, timeout_s
        self._clock = clock
        self._new: deque[Entry] = deque()  # appended by any thread, drained by the watchdog's
        self._live: list[Entry] = []  # the watchdog thread's (or poll()'s caller's) only
        self.reports: list[str] = []  # every message fired, for tests and post-mortems
        self.pending: CollectiveHang | None = None  # raised by the main thread at its next wait
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started = False  # start() was called (and stop() not since)
        self.polls = False  # watches works itself: set by configure() only (see the Note)

    def watch(self, work, op: str, label: str = "", group=None) -> None:
        """Register a collective just issued (O(1), no lock)."""
        if self.action != "off":
            self._new.append(Entry(work, op, label, group, self._clock()))

    def start(self) -> None:
        self.started = True
        if self.action == "off" or self.running():
            return
        self._stop.clear()
        # A daemon: the thread must never keep a finished (or crashing) process alive.
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self.started = False
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        self._thread = None

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def in_flight(self) -> int:
        """Collectives registered and not yet seen complete (as of the last poll)."""
        return len(self._live) + len(self._new)

    def take_pending(self) -> CollectiveHang | None:
        error, self.pending = self.pending, None
        return error

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:  # a bug here must not end the watching silently, nor crash
                log.exception("flatshard watchdog: poll failed")

    def poll(self, now: float | None = None) -> list[str]:
        """One pass: forget the completed collectives, report the oldest one past its bound.
        Returns the messages fired (one per hang: see below)."""
        now = self._clock() if now is None else now
        while self._new:
            self._live.append(self._new.popleft())
        self._live = [e for e in self._live if not _completed(e.work)]
        # While a reported collective is still in flight, the ones issued after it wait on it
        # (NCCL runs a group's collectives in order): their report would say nothing new.
        if any(e.reported for e in self._live):
            return []
        first = next((e for e in self._live if now - e.issued > self._bound(e)), None)
        if first is None:
            return []
        first.reported = True
        message = describe(first, now - first.issued, self._bound(first), self, len(self._live))
        self._fire(first, message)
        return [message]

    def _bound(self, entry: Entry) -> float:
        if entry.group_s is None:
            entry.group_s = group_timeout_s(entry.group) or -1.0  # -1: unreadable, read once
        group_s = entry.group_s if entry.group_s > 0 else None
        return bound_s(self.timeout_s, group_s, self.interval_s)

    def _fire(self, entry: Entry, message: str) -> None:
        self.reports.append(message)
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        if log.hasHandlers():  # without one, logging's last resort would print it twice
            log.error(message)
        if self.action in ("raise", "abort"):
            self.pending = CollectiveHang(message)
        if self.action == "abort":
            _abort(entry.group)


def _completed(work) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # a failed work is not a hang: its error surfaces at its wait
        return True


_NEXT = {
    "raise": "Next: CollectiveHang is raised at this rank's next flatshard wait "
    "(FLATSHARD_WATCHDOG=raise; the others: abort, report, off).",
    "abort": "Next: aborting the collective's process group now, and CollectiveHang is raised "
    "at this rank's next flatshard wait (FLATSHARD_WATCHDOG=abort).",
    "report": "Reporting only (FLATSHARD_WATCHDOG=report): the process group's own timeout "
    "ends the job.",
}


def describe(entry: Entry, age_s: float, bound: float, dog: Watchdog, in_flight: int) -> str:
    """The one message: who waits, on what, since when, and what to check."""
    try:
        rank = dist.get_rank() if dist.is_initialized() else 0  # world: names this process
    except RuntimeError:
        rank = "?"
    label = f" '{entry.label}'" if entry.label else ""
    behind = f" ({in_flight - 1} more issued after it are in flight too)" if in_flight > 1 else ""
    if entry.group_s is not None and entry.group_s > 0:
        group = f"the process group's own timeout is {entry.group_s:g} s, reported by 80% of it"
    else:
        group = "the process group's own timeout could not be read"
    return "\n".join(
        [
            f"[flatshard rank {rank}] watchdog: {entry.op}{label} over ranks "
            f"{_ranks(entry.group)} has not completed {age_s:.1f} s after it was "
            f"issued{behind}.",
            f"  Bound {bound:g} s: flatshard's timeout is {dog.timeout_s:g} s; {group}.",
            "  A peer rank has probably died, hung, or taken another code path (issued another "
            "collective, or none). Check the other ranks' logs and stacks (py-spy dump --pid); "
            "rerun with FLATSHARD_DEBUG=1 to report the first collective on which the ranks "
            "differ.",
            f"  {_NEXT[dog.action]}",
        ]
    )


def _ranks(group) -> str:
    if group is None:
        return "? (group not recorded)"
    try:
        return str(dist.get_process_group_ranks(group))
    except Exception:  # a destroyed group: the report must still go out
        return "?"


def _abort(group) -> None:
    """Abort the stuck collective's group (every group when it was not recorded): NCCL's
    kernels then exit, so a host blocked behind them wakes up and fails."""
    try:
        if group is not None:
            group.abort()
        else:  # torch's way to abort them all (NCCL needs the aborts grouped)
            abort_all = getattr(dist, "abort_process_group", None)
            (abort_all or dist.distributed_c10d._abort_process_group)()
    except Exception as err:  # the message is out already; the group's timeout remains
        sys.stderr.write(f"[flatshard] watchdog: could not abort the process group: {err}\n")


# ---- the process's watchdog -----------------------------------------------------------------
# [Note: one watchdog per process]
# It records every collective the process issues off Gloo, whichever model issued it
# (``PendingWork`` registers without knowing its model), so there is one per process. Its
# settings are a model's: ``fs.shard`` hands it the switches it read (``adopt``), and a later
# ``fs.shard`` the ones it read (the environment is per process, so they differ only when the
# program changed it in between). A process that issues flatshard collectives off Gloo and
# never called ``fs.shard`` (a ``fs.GradScaler`` over plain parameters) has no model to take
# them from: its first registration reads the environment once.
_DOG: Watchdog | None = None
_MAKING = threading.Lock()  # taken by fs.shard and by the first registration


def current() -> Watchdog | None:
    """The process's watchdog, None until ``fs.shard`` or a collective issued off Gloo."""
    return _DOG


def adopt(action: str, timeout_s: float) -> None:
    """``fs.shard``: the process's watchdog takes the switches the model read
    (``FLATSHARD_WATCHDOG``, its timeout). No thread starts (only ``configure`` polls).
    ``ValueError`` for an unknown action."""
    global _DOG
    if action not in ACTIONS:
        raise ValueError(f"FLATSHARD_WATCHDOG={action!r}: use one of {', '.join(ACTIONS)}")
    with _MAKING:
        if _DOG is None:
            _DOG = Watchdog(action=action, timeout_s=timeout_s)
        else:
            _DOG.action, _DOG.timeout_s = action, timeout_s
            if action == "off":
                _DOG.stop()


def watch(work, op: str, label: str = "", group=None) -> None:
    """A collective just issued off Gloo: one record in the collective log; a polling
    watchdog (``configure``) also watches its work, unless it runs on NCCL."""
    dog = _DOG if _DOG is not None else _make()
    if dog.action == "off":
        return
    collective_log.record(op, label, group)
    if dog.polls and not on_cuda(group):
        if not dog.started:
            dog.start()
        dog.watch(work, op, label, group)


def on_cuda(group) -> bool:
    """Whether ``group`` runs collectives on NCCL: their works are CUDA events, never polled
    from Python (the group's own watchdog does)."""
    if group is None and not dist.is_initialized():
        return False  # no process group: a work made by a test, never a device's
    try:
        return "nccl" in str(dist.get_backend(group)).lower()
    except Exception:  # unknown: assume a device, the safe side (no query)
        return True


def check(timeout: datetime.timedelta | None) -> None:
    """At each flatshard wait off Gloo: take flatshard's timeout (the engine's, passed to
    every wait), and raise the hang reported since the last call, once."""
    dog = _DOG
    if dog is None:
        return
    if isinstance(timeout, datetime.timedelta):  # (a caller without one keeps the last)
        dog.timeout_s = timeout.total_seconds()
    if dog.pending is not None and (error := dog.take_pending()) is not None:
        raise error


def configure(**settings) -> Watchdog:
    """Replace the process's watchdog by a started one with ``settings`` (``Watchdog``'s
    keywords); for tests and for programs that choose the action in code."""
    global _DOG
    reset()
    dog = Watchdog(**settings)
    dog.polls = True
    dog.start()
    _DOG = dog
    return dog


def reset() -> None:
    """Stop the thread and forget every collective; the next registration starts afresh."""
    global _DOG
    dog, _DOG = _DOG, None
    if dog is not None:
        dog.stop()


def _make() -> Watchdog:
    """The process's watchdog (no sharded model in this process, see [Note: one watchdog per
    process]): one set from the environment, not polling."""
    global _DOG
    with _MAKING:
        if _DOG is None:
            action = os.environ.get("FLATSHARD_WATCHDOG", "") or "raise"
            _DOG = Watchdog(action=action, timeout_s=_env_timeout_s())
    return _DOG


def _env_timeout_s() -> float:
    try:
        return float(os.environ.get("FLATSHARD_TIMEOUT_S", "") or DEFAULT_TIMEOUT_S)
    except ValueError:  # fs.shard reports a bad value; the bound needs only a number
        return DEFAULT_TIMEOUT_S


def _forget_in_child() -> None:
    """A forked child has no watchdog thread, and its parent's collectives are not its own."""
    global _DOG, _MAKING
    _DOG, _MAKING = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
