"""Every stream operation of flatshard, through one object per model (``Topology.streams``).

``fs.shard`` picks the implementation once, for the model's device and process group
(:func:`streams_for`): CUDA's streams on a CUDA device; the stream API a process group offers
(``group.flatshard_streams()``: the CPU test backend's virtual streams,
``flatshard.testing.virtual_streams``); otherwise none (every call below a no-op). Nothing else
in ``src/`` calls ``torch.cuda``'s stream, event, ``wait_stream`` or ``record_stream`` APIs.

[Note: streams and buffer lifetimes]
On CUDA, the work of a gather (writing this rank's shard into its chunk: a cast, or a copy
from pinned host memory under offload) and of a reduction (the pre-division) runs on two
high-priority side streams, ``gather`` and ``reduce``, and the collectives are issued from
them, so NCCL's stream waits on the side stream rather than on the compute stream: a
prefetched gather does not queue behind the compute issued before it, and a reduce-scatter
does not delay the next unit's compute. ProcessGroupNCCL's own rules: a collective runs on
its communicator's stream after waiting for the issuing (current) stream; ``Work.wait()``
makes only the *current* stream wait for it, then drops the tensors the work held; the
caching allocator hands freed memory at once to the stream that allocated it. The rules that
keep every buffer right without ``record_stream`` (the same reasoning as FSDP2's):

1. **Allocate on the compute stream.** Every buffer a side stream touches (full buffers,
   gradient shards, flat gradients) is allocated on the current (compute) stream *before*
   entering ``on_side_stream``: the caching allocator ties memory to the stream that
   allocated it, and only the compute stream ever frees it.
2. **Enter after the producer.** ``on_side_stream`` makes the side stream wait for the
   compute stream first: the shard the optimizer just wrote, the gradients autograd just
   produced, and the memory just allocated (maybe freed by compute-stream kernels a moment
   ago) are all ready before the side stream touches them.
3. **Consume after the wait.** The compute stream reads a gathered buffer or a gradient shard
   only after ``PendingWork.wait`` on the compute stream, which makes it wait for the
   collective (itself ordered after the side stream's work).
4. **Hold until waited on the allocating stream.** A collective's buffers stay referenced by
   their ``PendingWork`` (``keep_alive``) until a wait *on the compute stream* ordered after
   that collective; only then may the last reference go. A wait on a side stream (hybrid
   sharding's reduce-scatter, waited on the reduce stream before the replicas' all-reduce is
   issued behind it: ``comm/collectives.py`` ``then_issue``) orders only that side stream, so
   the buffers of the first collective are carried to the second's handle and dropped at
   its wait, on the compute stream (before: the flat gradient was dropped at the side
   stream's wait, and the allocator could hand it to compute-stream kernels while the
   reduce-scatter still read it).
The CPU test backend checks these rules (``flatshard.testing.virtual_streams``;
``tests/test_virtual_streams.py``); docs/gpu.md says what it cannot model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


class _Cuda:
    """``torch.cuda``'s stream API, in the shape every implementation offers (a process
    group's ``flatshard_streams()`` returns the same names)."""

    Event = staticmethod(lambda: torch.cuda.Event())

    @staticmethod
    def Stream(device=None, priority: int = 0):  # torch's name
        return torch.cuda.Stream(device, priority=priority)

    current_stream = staticmethod(lambda device=None: torch.cuda.current_stream(device))
    stream = staticmethod(lambda s: torch.cuda.stream(s))
    priority_range = staticmethod(lambda: torch.cuda.Stream.priority_range())

    @staticmethod
    def record_stream(tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)


CUDA = _Cuda()


@dataclass(frozen=True)
class Streams:
    """One model's streams: the API (None: no streams) and its two side streams."""

    api: Any = None
    device: torch.device | None = None
    gather: Any = None
    reduce: Any = None

    def side(self, kind: str):
        """The ``"gather"`` or ``"reduce"`` side stream, or None (no streams)."""
        return getattr(self, kind) if self.api is not None else None

    def current(self):
        return self.api.current_stream(self.device) if self.api is not None else None

    def wait_stream(self, waiter, producer) -> None:
        """``waiter`` runs what comes next after everything queued on ``producer`` so far."""
        if self.api is not None:
            waiter.wait_stream(producer)

    @contextmanager
    def use(self, stream) -> Iterator[None]:
        """Make ``stream`` current for the block (None: no change)."""
        if self.api is None or stream is None:
            yield
            return
        with self.api.stream(stream):
            yield

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """The allocator must not reuse ``tensor``'s memory before ``stream``'s work so far."""
        if self.api is not None and stream is not None:
            self.api.record_stream(tensor, stream)

    def event(self, stream=None):
        """An event recorded now on ``stream`` (default: the current one); None: no streams."""
        if self.api is None:
            return None
        event = self.api.Event()
        event.record(stream if stream is not None else self.current())
        return event

    def host_wait(self) -> None:
        """Block the host until the work queued on the current stream so far is done."""
        event = self.event()
        if event is not None:
            event.synchronize()


NO_STREAMS = Streams()


def streams_for(device: torch.device, group) -> Streams:
    """The streams of a model on ``device`` whose mesh talks over ``group`` (see the module)."""
    if device.type == "cuda":
        api = CUDA
    else:
        offer = getattr(group, "flatshard_streams", None)
        api = offer() if callable(offer) else None
    if api is None:
        return NO_STREAMS
    high = api.priority_range()[1]  # the most urgent: communication first
    return Streams(
        api=api,
        device=device,
        gather=api.Stream(device, priority=high),
        reduce=api.Stream(device, priority=high),
    )


@contextmanager
def on_side_stream(streams: Streams, kind: str) -> Iterator[None]:
    """Run the block on ``streams``' ``kind`` side stream after everything queued on the
    current (compute) stream so far (rule 2 of the Note); a no-op without streams."""
    side = streams.side(kind)
    if side is None:
        yield
        return
    streams.wait_stream(side, streams.current())
    with streams.use(side):
        yield


def host_waits_for_device(device: torch.device) -> None:
    """Block the host until the work queued on ``device``'s current stream is done (CUDA;
    nothing to wait for elsewhere: host copies off CUDA are synchronous)."""
    if device.type == "cuda":
        Streams(CUDA, device).host_wait()
