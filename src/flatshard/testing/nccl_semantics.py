"""``strict_async``: a process group that runs Gloo but holds the caller to NCCL's rules.

Why: every CPU test runs on Gloo, whose collectives write their outputs in place and whose
waits are host-side, so a program that reads an all-gather's output before ``wait()``, writes a
reduce-scatter's input while it is in flight, or frees a gathered buffer too early still gets
the right bytes there. Under ProcessGroupNCCL the same program races the GPU. This backend makes
those mistakes visible on the CPU:

- **Outputs are garbage until ``wait()``**: each collective runs on private scratch copies;
  the caller's outputs are filled with NaN (integers: their most negative value, or the
  largest for unsigned) at issue and receive the result inside ``wait()`` only. A read before
  the wait computes with NaN, which any parity check sees. As NCCL's in-place all-gather,
  an input that is a chunk of the output keeps its bytes.
- **Inputs must not change while in flight**: every input and output is snapshotted (bits)
  at issue and compared at ``wait()``; a change is a violation.
- **Buffers in flight stay allocated**: ``UntypedStorage.resize_`` of a storage with a
  collective in flight is a violation at the call (flatshard frees buffers that way), and
  at ``wait()`` each storage must still have its address and size.
- **Timed waits are counted**: ProcessGroupNCCL's ``wait(timeout)`` blocks the host until the
  collective completes; flatshard must call ``wait()`` on non-Gloo backends.
- Every tensor's device and pinning is counted per op, and extra per-tensor checks can be
  added (``add_tensor_check``: ``virtual_device`` adds the host-vs-compute one).

The name must contain neither "nccl" (flatshard would pick CUDA as the compute device) nor be
"gloo" (flatshard would take its Gloo-only point-to-point path): flatshard then runs exactly
the path it runs under NCCL, on the CPU. Violations are recorded per process (``report()``)
and raised as ``NcclSemanticsViolation`` naming the op and where it was issued, unless
``configure(raise_on_violation=False)`` (the parity suite: ranks stay in step and each case
reports its violations). ``register()`` must run in each process before the group is made.
"""

from __future__ import annotations

import datetime
import sys
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ProcessGroupGloo,
    ReduceScatterOptions,
    ScatterOptions,
)

from flatshard.testing import stream_access, virtual_streams
from flatshard.testing._buffers import Watched, overlaps, poison

BACKEND = "strict_async"
_NO_TIMEOUT = datetime.timedelta(0)  # c10d's kNoTimeout
TensorCheck = Callable[[str, torch.Tensor], "str | None"]


class NcclSemanticsViolation(AssertionError):
    """A use of a collective that is wrong under NCCL. Not a RuntimeError, so that flatshard's
    ``PendingWork.wait`` does not rewrap it as a timeout."""


@dataclass
class _Registry:
    violations: list[str] = field(default_factory=list)
    timed_waits: Counter = field(default_factory=Counter)  # "op at call site" -> count
    calls: Counter = field(default_factory=Counter)  # op -> count
    devices: Counter = field(default_factory=Counter)  # (op, device type, pinned) -> tensors
    in_flight: dict[int, StrictWork] = field(default_factory=dict)
    storages: dict[int, list] = field(default_factory=dict)  # id(storage) -> [storage, op, n]
    raise_on_violation: bool = True
    tensor_checks: list[TensorCheck] = field(default_factory=list)


_REG = _Registry()
_LOCK = threading.RLock()  # a Work may be waited from another thread than its issuer's


def reset() -> None:
    """Forget everything recorded so far (settings and tensor checks stay)."""
    with _LOCK:
        _REG.violations.clear()
        _REG.timed_waits.clear()
        _REG.calls.clear()
        _REG.devices.clear()
        _REG.in_flight.clear()
        _REG.storages.clear()


def configure(*, raise_on_violation: bool) -> None:
    _REG.raise_on_violation = raise_on_violation


def add_tensor_check(check: TensorCheck) -> None:
    """``check(op, tensor)`` runs on every tensor handed to a collective; a string it returns
    is a violation."""
    _REG.tensor_checks.append(check)


def remove_tensor_check(check: TensorCheck) -> None:
    _REG.tensor_checks.remove(check)


def report() -> dict:
    """This process's record since ``reset()``: violations, timed waits, collectives issued,
    tensors per (op, device, pinned), and the collectives issued but never waited."""
    with _LOCK:
        return {
            "violations": list(_REG.violations),
            "timed_waits": sum(_REG.timed_waits.values()),
            "timed_wait_sites": dict(_REG.timed_waits),
            "calls": dict(_REG.calls),
            "devices": {
                f"{op} {dev}{' pinned' if pin else ''}": n
                for (op, dev, pin), n in _REG.devices.items()
            },
            "never_waited": sorted(f"{w.op} issued at {w.site}" for w in _REG.in_flight.values()),
        }


def _violate(message: str) -> None:
    with _LOCK:
        _REG.violations.append(message)
    if _REG.raise_on_violation:
        raise NcclSemanticsViolation(message)


def _call_site() -> str:
    """Where flatshard issued the call: its innermost frame, and the first one outside
    ``flatshard/comm/`` (the feature that asked); else the innermost frame outside torch."""
    frame, found, fallback = sys._getframe(2), [], None
    while frame is not None and len(found) < 2:
        name = frame.f_code.co_filename
        if "/torch/" not in name and "/flatshard/testing/" not in name:
            here = f"{name.rsplit('/src/', 1)[-1]}:{frame.f_lineno}"
            if "/flatshard/" in name and (not found or "/flatshard/comm/" not in name):
                found.append(here)
                if "/flatshard/comm/" not in name:
                    break
            fallback = fallback or here
        frame = frame.f_back
    return " <- ".join(found) if found else fallback or "?"


# ---- buffers in flight -----------------------------------------------------------------------
def _hold_storages(watched: list[Watched], op: str) -> None:
    with _LOCK:
        for w in watched:
            entry = _REG.storages.setdefault(id(w.storage), [w.storage, op, 0])
            entry[2] += 1


def _release_storages(watched: list[Watched]) -> None:
    with _LOCK:
        for w in watched:
            entry = _REG.storages.get(id(w.storage))
            if entry is not None:
                entry[2] -= 1
                if entry[2] <= 0:
                    del _REG.storages[id(w.storage)]


_ORIGINAL_RESIZE = torch.UntypedStorage.resize_


def _guarded_resize(self, size):
    """``UntypedStorage.resize_`` that refuses to free or move a buffer with a collective in
    flight: under NCCL the kernel would write freed (or reused) memory."""
    entry = _REG.storages.get(id(self))
    if entry is not None and entry[0] is self:
        _violate(
            f"{entry[1]}: a buffer in flight was resized to {size} bytes at {_call_site()} "
            "before the collective's wait()"
        )
    stream_access.resized(self, size)  # under virtual streams: a free, then an allocation
    return _ORIGINAL_RESIZE(self, size)


# ---- the work and the group --------------------------------------------------------------------
class StrictWork(dist.Work):
    """A collective in flight: Gloo's work on scratch copies, plus what ``wait()`` checks and
    copies into the caller's outputs."""

    def __init__(self, op, inner, copies, watched, site: str, timeout) -> None:
        super().__init__()
        self.op, self.site = op, site
        self._inner, self._copies, self._watched = inner, copies, watched
        self._timeout = timeout  # the group's: bounds an untimed wait on Gloo's side
        self._done = False
        self.stream = None  # under virtual streams: the collective's own (stream_access)
        self._lock = threading.Lock()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        timed = timeout is not None and timeout != _NO_TIMEOUT
        if timed:
            with _LOCK:
                _REG.timed_waits[f"{self.op} at {_call_site()}"] += 1
        # Our own tensor ops are not the caller's: no torch-function mode sees them (the
        # virtual device would count the snapshots' comparisons as the caller's).
        with self._lock, torch._C.DisableTorchFunction(), virtual_streams.paused():
            # ProcessGroupNCCL's rule: the current stream waits for the collective's end,
            # then the work drops the tensors it held (a free here is checked against that).
            stream_access.joined(self.stream)
            if self._done:
                return True
            if self._inner is not None:
                self._inner.wait(timeout if timed else self._timeout)
            problems = [p for p in (w.problem() for w in self._watched) if p]
            for out, scratch in self._copies:
                if out.untyped_storage().nbytes():  # (a freed buffer was reported above)
                    out.data.copy_(scratch)
            self._done = True
            _release_storages(self._watched)
            with _LOCK:
                _REG.in_flight.pop(id(self), None)
            self._inner = self._copies = self._watched = None
        for problem in problems:
            _violate(f"{self.op} issued at {self.site}: {problem}")
        return True

    def is_completed(self) -> bool:
        return self._done  # results reach the caller's tensors in wait() only

    def is_success(self) -> bool:
        return self._done

    def synchronize(self) -> None:
        self.wait()


class StrictAsyncGroup(dist.ProcessGroup):
    """The ``strict_async`` process group: Gloo over the same store and ranks, NCCL's rules."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._gloo = ProcessGroupGloo(store, rank, size, timeout)
        self._timeout = timeout

    def getBackendName(self) -> str:  # c10d's name
        return BACKEND

    def flatshard_streams(self):
        """The stream API ``fs.shard`` uses for a model on this group (``core/streams.py``):
        virtual streams while a ``virtual_streams.session()`` is open, else None."""
        return virtual_streams.API if virtual_streams.active() else None

    # c10d keeps a group's name in its backends, and this group registers none (a C++ caller
    # that would bypass the checks fails instead), so the name lives here.
    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        return self._name

    def _issue(self, op: str, inputs: list, outputs: list, run: Callable) -> StrictWork:
        """Run ``run(scratch_of)`` (Gloo, on scratch copies) with the caller's ``outputs``
        poisoned until ``wait()`` and everything watched. A tensor in both lists is in place."""
        with torch._C.DisableTorchFunction(), virtual_streams.paused():  # as in wait()
            return self._issue_plain(_call_site(), op, inputs, outputs, run)

    def _issue_plain(self, site, op, inputs, outputs, run) -> StrictWork:
        unique = list({id(t): t for t in [*inputs, *outputs]}.values())
        self._check_tensors(op, unique, site)
        ins, outs = {id(t) for t in inputs}, {id(t) for t in outputs}
        scratch = {
            id(t): t.detach().clone() if id(t) in ins else torch.empty_like(t) for t in unique
        }
        for t in outputs:
            poison(t)
        for t in inputs:  # in-place all-gather: this rank's chunk is the input, NCCL keeps it
            if id(t) not in outs and any(overlaps(t, o) for o in outputs):
                t.data.copy_(scratch[id(t)])
        roles = {id(t): "output" if id(t) in outs else "input" for t in unique}
        watched = [Watched(roles[id(t)], t) for t in unique]
        _hold_storages(watched, op)
        inner = run(lambda t: scratch[id(t)])
        copies = [(t, scratch[id(t)]) for t in outputs]
        work = StrictWork(op, inner, copies, watched, site, self._timeout)
        work.stream = stream_access.collective(op, inputs, outputs, site)
        with _LOCK:
            _REG.calls[op] += 1
            _REG.in_flight[id(work)] = work
        return work

    def _check_tensors(self, op: str, tensors: list, site: str) -> None:
        for t in tensors:
            with _LOCK:
                _REG.devices[(op, t.device.type, t.is_pinned())] += 1
            if t.is_pinned():
                _violate(f"{op} at {site}: a pinned host tensor was handed to a collective")
            for check in list(_REG.tensor_checks):
                problem = check(op, t)
                if problem:
                    _violate(f"{op} at {site}: {problem}")

    # ---- the collectives (the names torch 2.13's distributed_c10d calls, and older ones) ----
    def all_gather_single(self, output, input, opts=None):
        opts = opts or AllgatherOptions()
        run = lambda s: self._gloo._allgather_base(s(output), s(input), opts)  # noqa: E731
        return self._issue("all_gather", [input], [output], run)

    _allgather_base = all_gather_single

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts or ReduceScatterOptions()
        run = lambda s: self._gloo._reduce_scatter_base(s(output), s(input), opts)  # noqa: E731
        return self._issue("reduce_scatter", [input], [output], run)

    _reduce_scatter_base = reduce_scatter_single

    def allreduce(self, tensors, opts=None):
        if opts is None or isinstance(opts, dist.ReduceOp.RedOpType):
            opts = AllreduceOptions() if opts is None else _allreduce_options(opts)
        run = lambda s: self._gloo.allreduce([s(t) for t in tensors], opts)  # noqa: E731
        return self._issue("all_reduce", tensors, tensors, run)

    def broadcast(self, tensors, opts=None):
        opts = opts or BroadcastOptions()
        outputs = [] if self.rank() == opts.rootRank else tensors  # the root's is an input
        run = lambda s: self._gloo.broadcast([s(t) for t in tensors], opts)  # noqa: E731
        return self._issue("broadcast", tensors, outputs, run)

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts or AllgatherOptions()
        outputs = [t for ts in output_lists for t in ts]

        def run(s):
            return self._gloo.allgather(_nested(s, output_lists), [s(t) for t in inputs], opts)

        return self._issue("all_gather_list", inputs, outputs, run)

    def gather(self, output_lists, inputs, opts=None):
        opts = opts or GatherOptions()
        outputs = [t for ts in output_lists for t in ts]

        def run(s):
            return self._gloo.gather(_nested(s, output_lists), [s(t) for t in inputs], opts)

        return self._issue("gather", inputs, outputs, run)

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts or ScatterOptions()
        inputs = [t for ts in input_lists for t in ts]

        def run(s):
            return self._gloo.scatter([s(t) for t in outputs], _nested(s, input_lists), opts)

        return self._issue("scatter", inputs, outputs, run)

    def all_to_all_single(self, output, input, out_splits, in_splits, opts=None):
        opts = opts or AllToAllOptions()

        def run(s):
            return self._gloo.alltoall_base(s(output), s(input), out_splits, in_splits, opts)

        return self._issue("all_to_all", [input], [output], run)

    alltoall_base = all_to_all_single

    def barrier(self, opts=None):
        opts = opts or BarrierOptions()
        return self._issue("barrier", [], [], lambda s: self._gloo.barrier(opts))

    def send(self, tensors, dst: int, tag: int = 0):
        run = lambda s: self._gloo.send([s(t) for t in tensors], dst, tag)  # noqa: E731
        return self._issue("send", tensors, [], run)

    def recv(self, tensors, src: int, tag: int = 0):
        run = lambda s: self._gloo.recv([s(t) for t in tensors], src, tag)  # noqa: E731
        return self._issue("recv", [], tensors, run)


def _nested(scratch_of: Callable, lists: list) -> list:
    return [[scratch_of(t) for t in ts] for ts in lists]


def _allreduce_options(op) -> AllreduceOptions:
    opts = AllreduceOptions()
    opts.reduceOp = op
    return opts


def _create(store, rank: int, size: int, timeout: datetime.timedelta) -> StrictAsyncGroup:
    return StrictAsyncGroup(store, rank, size, timeout)


def register() -> None:
    """Make ``init_process_group("strict_async")`` / ``new_group(backend="strict_async")``
    available in this process, and guard ``UntypedStorage.resize_`` (idempotent)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
    torch.UntypedStorage.resize_ = _guarded_resize
