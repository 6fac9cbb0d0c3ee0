"""Vector clocks, virtual streams and events, and the per-process state of ``virtual_streams``
(the module that opens a session and offers the stream API; ``stream_access`` records and
checks the accesses)."""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

Clock = dict[int, int]  # stream id -> epoch


def join(into: Clock, other: Clock) -> None:
    for sid, epoch in other.items():
        if into.get(sid, 0) < epoch:
            into[sid] = epoch


class VStream:
    """One virtual stream (``torch.cuda.Stream``'s methods that ordering needs)."""

    _ids = itertools.count(1)

    def __init__(self, name: str = "", priority: int = 0) -> None:
        self.id = next(VStream._ids)
        self.name = name or f"side stream {self.id}"
        self.priority = priority
        self.clock: Clock = {self.id: 0}

    def __repr__(self) -> str:
        return self.name

    def tick(self) -> int:
        """A kernel on this stream: its epoch."""
        self.clock[self.id] += 1
        return self.clock[self.id]

    def after(self, stream_id: int, epoch: int) -> bool:
        """Is this stream's present ordered after epoch ``epoch`` of stream ``stream_id``?"""
        return stream_id == self.id or self.clock.get(stream_id, 0) >= epoch

    # ---- torch.cuda.Stream ---------------------------------------------------------------
    def wait_stream(self, stream: VStream) -> None:
        join(self.clock, stream.clock)

    def record_event(self, event: VEvent | None = None) -> VEvent:
        event = event or VEvent()
        event.record(self)
        return event

    def wait_event(self, event: VEvent) -> None:
        join(self.clock, event.clock)

    def synchronize(self) -> None:
        """The host waits: nothing to order between streams (the host is not modelled)."""

    def query(self) -> bool:
        return True


class VEvent:
    """``torch.cuda.Event``: the clock of a stream when recorded."""

    def __init__(self, *args, **kwargs) -> None:
        self.clock: Clock = {}

    def record(self, stream: VStream | None = None) -> VEvent:
        self.clock = dict((stream or WORLD.current).clock)
        return self

    def wait(self, stream: VStream | None = None) -> None:
        (stream or WORLD.current).wait_event(self)

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


@dataclass
class Violation:
    """One ordering violation: ``kind`` (free / read / write), and the message."""

    kind: str
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass
class World:
    """This process's virtual streams while a session is open."""

    active: bool = False
    compute: VStream | None = None
    current: VStream | None = None
    violations: list[Violation] = field(default_factory=list)
    paused: int = 0  # > 0: the backend's own tensor work (scratch copies), not the program's
    collectives: int = 0
    issuers: Counter = field(default_factory=Counter)  # issuing stream -> collectives
    thread: int = 0  # the thread that opened the session: the program's

    def open(self) -> None:
        self.thread = threading.get_ident()
        self.compute = self.current = VStream("compute")
        self.violations = []
        self.collectives = 0
        self.issuers = Counter()
        self.active = True

    def collective_stream(self, op: str) -> VStream:
        """A collective's own stream, ordered after the issuing (current) stream."""
        self.collectives += 1
        self.issuers["compute" if self.current is self.compute else "side"] += 1
        stream = VStream(f"{op}#{self.collectives}")
        join(stream.clock, self.current.clock)
        return stream


WORLD = World()  # per process (the test backend's state; flatshard keeps none)


@contextmanager
def paused() -> Iterator[None]:
    """The backend's own tensor work: not recorded as the program's accesses."""
    WORLD.paused += 1
    try:
        yield
    finally:
        WORLD.paused -= 1
