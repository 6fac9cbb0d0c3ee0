"""``HostSyncs``: what blocks the host in a training step, counted on the CPU.

Why: on a device backend (NCCL) the host must run ahead of the GPU: a step that makes it wait
for the device (a host read of a device value), for a peer (a collective on a Gloo side group)
or for a collective to complete (``wait(timeout)``) drains the queue the host built up, and
on a CPU run none of that shows. Under the ``strict_async`` backend (``nccl_semantics``: the
path flatshard runs under NCCL) and the virtual compute device (``virtual_device``: host and
compute tensors told apart), ``HostSyncs`` records, per step window (``step()``), every one of
these that flatshard's own code makes (the innermost frame under ``flatshard/`` outside
``flatshard/testing/``; a test's ``loss.item()`` is not flatshard's):

- ``gloo``: a collective on a Gloo group while the job's backend is not Gloo (a side group);
- ``read``: ``.item()``, ``.tolist()``, ``bool()``, ``float()``, ``int()`` of a compute-device
  tensor, or an op whose output size depends on a compute tensor's values (``nonzero``, a
  boolean-mask index, ...): each waits for the device to get there;
- ``to_host``: a blocking copy of a compute tensor to the host (``.cpu()``, ``.to(host)``,
  ``copy_`` without ``non_blocking=True``);
- ``to_device``: a blocking copy of host data to the compute device (``.to(device)``,
  ``copy_`` without ``non_blocking=True``, ``torch.tensor(data, device=)``): on CUDA torch
  waits for the stream after such a copy;
- ``timed_wait``: a collective's ``wait(timeout)`` (``nccl_semantics`` counts them);
- ``cuda_sync``: ``torch.cuda.synchronize``, ``Event.synchronize``, ``Stream.synchronize``.

Some host waits are part of a feature, as in torch's own equivalent; they are counted apart,
per reason, when the event happens inside one of the functions of ``SEPARATE`` (and the
offload wait is counted at its call: on the CPU it has nothing to wait for). Everything the
model's own code does (``flatshard/models/``, e.g. an MoE's all-to-all split sizes) is
counted apart as well.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from flatshard.testing.virtual_device import _HOST_READS, DEV, HOST, VirtualDevice

# "file under flatshard/:function" -> why that host wait is the feature's (see the docs'
# "How usage is agreed" in engine.md and the [Note: host waits] of each file)
SEPARATE = {
    "core/usage.py:read_agreed_usage": "usage read: a rank with a parameter it did not use "
    "reads the agreed flags (as DDP's find_unused_parameters reads its map)",
    "offload.py:wait_for_host_copies": "offload: the host waits for the gradients' copies "
    "before the optimizer reads them (as FSDP2's grad_offload_event.synchronize())",
    "optim/grad_norm.py:norm_on_host": "offload clip: host-resident gradients are scaled by "
    "the norm on the host",
    "optim/adafactor.py:offload_sums_on_host": "offload Adafactor: the host-resident state "
    "reads the reduced statistics",
    "optim/grad_norm.py:check_finite": "clip error_if_nonfinite: the norm is read (as torch's)",
    "optim/grad_scaler.py:_sync": "fs.GradScaler's found-inf check (as torch.amp.GradScaler)",
    "optim/grad_scaler.py:_unscale_grads": "fs.GradScaler's found-inf check (as "
    "torch.amp.GradScaler)",
}
MODEL = "the model's own code (flatshard/models/)"
_SHAPE_READS = {"nonzero", "masked_select", "unique", "unique_consecutive", "argwhere"}
# Not the point-to-point ones: torch's P2POp checks ``op`` by identity (``dist.isend``), and
# flatshard sends point to point on Gloo groups only when the job runs Gloo (``gloo_p2p``).
_COLLECTIVES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single", "all_to_all",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "barrier", "gather", "scatter", "reduce",
)  # fmt: skip


@dataclass
class StepRecord:
    """One step window: host-blocking events by kind (``"kind what at site"``), and the
    separately counted ones by reason."""

    blocking: list[str] = field(default_factory=list)
    separate: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        return {"blocking": list(self.blocking), "separate": dict(self.separate)}


class HostSyncs(VirtualDevice):
    """The virtual compute device that also counts host-blocking events per step window.

    Enter it around a whole case (model building included), as ``VirtualDevice``, with
    ``flatshard.core.mesh.compute_device`` patched to return ``COMPUTE``; wrap each step in
    ``with syncs.step():``; ``records`` holds one ``StepRecord`` per step."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[StepRecord] = []
        self._current: StepRecord | None = None
        self._depth = 0  # VirtualDevice re-enters itself around backward
        self._undo: list = []
        self._timed_at_start: Counter = Counter()

    # ---- the window --------------------------------------------------------------------------
    @contextmanager
    def step(self):
        record = StepRecord()
        self.records.append(record)
        self._current, self._timed_at_start = record, _timed_waits()
        try:
            yield record
        finally:
            for site, n in (_timed_waits() - self._timed_at_start).items():
                record.blocking.extend([f"timed_wait {site}"] * n)
            self._current = None

    def summary(self) -> list[dict]:
        return [r.as_dict() for r in self.records]

    def note(self, kind: str, what: str) -> None:
        """Record an event of flatshard's code (ignored outside a window or flatshard)."""
        if self._current is None:
            return
        site, separate = _classify_stack()
        if site is None:
            return
        if separate is not None:
            self._current.separate[separate] += 1
        else:
            self._current.blocking.append(f"{kind} {what} at {site}")

    # ---- install / remove the wrappers ----------------------------------------------------------
    def __enter__(self):
        self._depth += 1
        if self._depth == 1:
            self._install()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._depth -= 1
            if self._depth == 0:
                for undo in reversed(self._undo):
                    undo()
                self._undo.clear()

    def _install(self) -> None:
        for name in _COLLECTIVES:
            if hasattr(dist, name):
                self._patch(dist, name, self._collective(getattr(dist, name), name))
        if hasattr(torch.cuda, "synchronize"):
            self._patch(torch.cuda, "synchronize", self._blocking(torch.cuda.synchronize))
        for cls in (torch.cuda.Event, torch.cuda.Stream, *_virtual_stream_classes()):
            self._patch(cls, "synchronize", self._blocking(cls.synchronize))
        from flatshard import offload

        wait = offload.wait_for_host_copies
        self._patch(offload, "wait_for_host_copies", self._offload_wait(wait))

    def _patch(self, owner, name: str, value) -> None:
        old = owner.__dict__[name] if name in owner.__dict__ else getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, old))

    def _collective(self, fn, name: str):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if self._current is not None and dist.get_backend() != "gloo":
                try:
                    group = signature.bind_partial(*args, **kwargs).arguments.get("group")
                except TypeError:
                    group = None
                if dist.get_backend(group) == "gloo":
                    self.note("gloo", name)
            return fn(*args, **kwargs)

        return wrapper

    def _blocking(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            self.note("cuda_sync", getattr(fn, "__name__", "synchronize"))
            return fn(*args, **kwargs)

        return wrapper

    def _offload_wait(self, fn):
        """The offload wait blocks only where the compute device is not the host (CUDA, or
        this virtual device); on the CPU it has nothing to wait for, so it is counted here."""

        @functools.wraps(fn)
        def wait_for_host_copies(device, *args, **kwargs):
            if torch.device(device) != torch.device("cpu") and self._current is not None:
                self._current.separate[SEPARATE["offload.py:wait_for_host_copies"]] += 1
            with _quiet(self):  # its own synchronize is this one wait
                return fn(device, *args, **kwargs)

        return wait_for_host_copies

    # ---- tensor ops ------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._current is not None and func is not torch.Tensor.device.__get__:
            event = self._blocking_op(getattr(func, "__name__", ""), args, kwargs)
            if event is not None:
                self.note(*event)
        return super().__torch_function__(func, types, args, kwargs)

    def _blocking_op(self, name: str, args, kwargs) -> tuple[str, str] | None:
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name in ("tensor", "as_tensor"):
            target = self._target(name, args, kwargs)
            data = args[0] if args else kwargs.get("data")
            on_device = isinstance(data, torch.Tensor) and self.tag(data) == DEV
            return ("to_device", name) if target == DEV and not on_device else None
        if first is None:
            return None
        side = self.tag(first)
        if name in _HOST_READS or name in _SHAPE_READS:
            return ("read", name) if side == DEV else None
        if name == "__getitem__" and side == DEV and _bool_index(args[1:2]):
            return ("read", "boolean-mask index")
        if name == "repeat_interleave" and side == DEV and "output_size" not in kwargs:
            return (
                ("read", name)
                if isinstance(_arg(args, kwargs, 1, "repeats"), torch.Tensor)
                else None
            )
        return self._blocking_copy(name, first, side, args, kwargs)

    def _blocking_copy(self, name: str, first, side: str, args, kwargs):
        if name in ("to", "cpu", "cuda"):
            target = self._target(name, args, kwargs) or side
            quiet = _non_blocking(args[1:], kwargs) and name != "cpu"
        elif name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
            target, side = side, self.tag(args[1])  # into ``first`` from ``args[1]``
            quiet = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
        elif name == "__setitem__" and len(args) > 2 and isinstance(args[2], torch.Tensor):
            target, side = side, self.tag(args[2])
            quiet = False
        else:
            return None
        if target == side or quiet:
            return None
        return ("to_host", name) if target == HOST else ("to_device", name)


@contextmanager
def _quiet(syncs: HostSyncs):
    current, syncs._current = syncs._current, None
    try:
        yield
    finally:
        syncs._current = current


def _virtual_stream_classes() -> tuple:
    """The CPU test backend's virtual streams and events, where that module exists."""
    try:
        from flatshard.testing import virtual_streams
    except ImportError:
        return ()
    return tuple(
        getattr(virtual_streams, n) for n in ("VStream", "VEvent") if hasattr(virtual_streams, n)
    )


def _timed_waits() -> Counter:
    from flatshard.testing import nccl_semantics

    return Counter(nccl_semantics.report()["timed_wait_sites"])


def _non_blocking(rest, kwargs) -> bool:
    return bool(kwargs.get("non_blocking", False)) or any(a is True for a in rest)


def _arg(args, kwargs, index: int, name: str):
    return args[index] if len(args) > index else kwargs.get(name)


def _bool_index(index) -> bool:
    items = index[0] if index and isinstance(index[0], tuple) else index
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in items)


def _classify_stack() -> tuple[str | None, str | None]:
    """(flatshard's site: its innermost frame, and the first one outside ``comm/`` when that
    is another; the ``SEPARATE`` reason or ``MODEL`` the event falls under)."""
    frame, sites, separate = sys._getframe(2), [], None
    while frame is not None:
        name = frame.f_code.co_filename
        if "/flatshard/" in name and "/flatshard/testing/" not in name:
            where = name.rsplit("/flatshard/", 1)[-1]
            if not sites and where.startswith("models/"):
                separate = MODEL
            if not sites or (len(sites) == 1 and sites[0].startswith("comm/")):
                sites.append(f"{where}:{frame.f_lineno}")
            separate = separate or SEPARATE.get(f"{where}:{frame.f_code.co_name}")
        frame = frame.f_back
    return (" <- ".join(sites) if sites else None), separate
