"""Side streams for communication on CUDA (nothing on the CPU path).

[Note: streams and buffer lifetimes]
On CUDA, the work of a gather (writing this rank's shard into its chunk: a cast, or a copy
from pinned host memory under offload) and of a reduction (the pre-division) runs on two
high-priority side streams, ``gather`` and ``reduce``, and the collectives are issued from
them, so NCCL's stream waits on the side stream rather than on the compute stream: a
prefetched gather does not queue behind the compute issued before it, and a reduce-scatter
does not delay the next unit's compute. The rules that keep every buffer right without
``record_stream`` (the same reasoning as FSDP2's):

1. **Allocate on the compute stream.** Every buffer a side stream touches (full buffers,
   gradient shards) is allocated on the current (compute)
   stream *before* entering ``on_side_stream``: the caching allocator ties memory to the
   stream that allocated it, and only the compute stream ever frees it.
2. **Enter after the producer.** ``on_side_stream`` makes the side stream wait for the
   compute stream first: the shard the optimizer just wrote, the gradients autograd just
   produced, and the memory just allocated (maybe freed by compute-stream kernels a moment
   ago) are all ready before the side stream touches them.
3. **Consume after the wait.** The compute stream reads a gathered buffer or a gradient shard
   only after ``PendingWork.wait``, which on NCCL makes the current stream wait for the
   collective (itself ordered after the side stream's work).
4. **Hold until waited.** A side stream's inputs stay referenced by their ``PendingWork``
   (``keep_alive``) until that wait; only then may the compute stream free or reuse them, and
   anything it does afterwards is ordered after the collective by rule 3.
On the CPU (and for any device without streams) ``on_side_stream`` is a no-op.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CommStreams:
    """The side streams of one device (CUDA only)."""

    gather: torch.cuda.Stream
    reduce: torch.cuda.Stream


def comm_streams(device: torch.device) -> CommStreams | None:
    """High-priority side streams on a CUDA ``device``; None anywhere else."""
    if device.type != "cuda":
        return None
    high = torch.cuda.Stream.priority_range()[1]  # the most urgent: communication first
    return CommStreams(
        gather=torch.cuda.Stream(device, priority=high),
        reduce=torch.cuda.Stream(device, priority=high),
    )


@contextmanager
def on_side_stream(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Run the block on ``stream`` after everything queued on the compute stream so far
    (rule 2 of the Note); a no-op for ``None`` (CPU)."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield
