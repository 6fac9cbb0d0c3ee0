"""Virtual CUDA streams on the CPU: happens-before between streams, by vector clocks.

Why: every CPU test runs eagerly on the host, so a program that forgets a ``wait_stream``,
waits for a collective on the wrong stream, or lets the caching allocator hand a buffer to the
compute stream while a collective still reads it, gets the right bytes anyway. Under
:func:`session` the code that runs on CUDA runs with *virtual* streams instead: nothing is
reordered (everything still runs at once, in program order), but every kernel, collective and
free is placed on a stream and checked against what CUDA would guarantee (the checks are in
``stream_access``). The streams:

- the **compute** stream (the default: ``current_stream()`` outside any ``stream(s)``);
- every ``Stream()`` made (flatshard's side streams, FSDP2's);
- each **collective's own** stream (``nccl_semantics`` makes one per collective, as
  ProcessGroupNCCL queues its kernel on an internal stream that first waits for the issuing
  one; one per collective, not one per communicator: a program that relied on two collectives
  of one group running in order would be flagged).

Each stream carries a vector clock (stream id -> the last epoch of that stream it is ordered
after). A kernel ticks its stream; ``a.wait_stream(b)``, ``a.wait_event(e)`` and
``Work.wait()`` (the current stream waits for the collective's end) join clocks. An access
``(stream s, epoch e)`` happens before the present of stream ``t`` iff ``t.clock[s] >= e``.

The API (:data:`API`) mirrors the part of ``torch.cuda`` flatshard uses (``Stream``,
``current_stream``, ``stream``, ``Event``, ``priority_range``, plus ``record_stream(tensor,
stream)``); ``nccl_semantics.StrictAsyncGroup.flatshard_streams`` hands it to ``fs.shard``
while a session is open. :func:`session` also stands it in for ``torch.cpu``'s stream stubs,
which torch's FSDP2 uses on a CPU mesh. State is per process (:data:`WORLD`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from flatshard.testing import stream_access
from flatshard.testing._clocks import WORLD, VEvent, Violation, VStream, World, join, paused

__all__ = ["API", "WORLD", "VEvent", "VStream", "Violation", "World", "active", "current",
           "join", "paused", "session"]  # fmt: skip


# ---- the torch.cuda-like API ---------------------------------------------------------------
class _Api:
    """What flatshard's ``core/streams.py`` calls on ``torch.cuda``, on virtual streams."""

    Event = VEvent

    @staticmethod
    def Stream(device=None, priority: int = 0) -> VStream:  # torch's name
        return VStream(priority=priority)

    @staticmethod
    def current_stream(device=None) -> VStream:
        return WORLD.current

    @staticmethod
    @contextmanager
    def stream(stream: VStream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        before, WORLD.current = WORLD.current, stream
        try:
            yield
        finally:
            WORLD.current = before

    @staticmethod
    def record_stream(tensor: torch.Tensor, stream: VStream) -> None:
        stream_access.record_stream(tensor, stream)

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return (0, -1)

    @staticmethod
    def synchronize(device=None) -> None:
        pass


API = _Api()


def active() -> bool:
    return WORLD.active


def current() -> VStream:
    return WORLD.current


# ---- torch.cpu's stream stubs (FSDP2 on a CPU mesh) ----------------------------------------
class _CpuStream(VStream):
    """``torch.cpu.Stream(priority=)`` as a virtual stream (FSDP2's constructor call)."""

    def __init__(self, priority: int = -1) -> None:
        super().__init__(priority=priority)


_CPU_NAMES = ("Stream", "Event", "current_stream", "stream")


@contextmanager
def _cpu_streams() -> Iterator[None]:
    saved = {name: getattr(torch.cpu, name) for name in _CPU_NAMES}
    torch.cpu.Stream, torch.cpu.Event = _CpuStream, VEvent
    torch.cpu.current_stream, torch.cpu.stream = API.current_stream, API.stream
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(torch.cpu, name, value)


@contextmanager
def session() -> Iterator[World]:
    """Run the block with virtual streams: the compute stream current, every tensor access
    recorded (``stream_access.AccessMode``), frees checked; yields the world whose
    ``violations`` list fills up. Build the model (``fs.shard``) inside it."""
    if WORLD.active:
        raise RuntimeError("virtual_streams.session() is already open in this process")
    WORLD.open()
    stream_access.reset()
    try:
        with _cpu_streams(), stream_access.AccessMode():
            yield WORLD
    finally:
        WORLD.active = False
        stream_access.reset()
        WORLD.current = WORLD.compute = None
