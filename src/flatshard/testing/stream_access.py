"""Every tensor access on its virtual stream, and the caching allocator's rule.

The checks of ``virtual_streams``.

:class:`AccessMode` is a ``TorchDispatchMode`` that classifies each aten op's tensors as
torch's CUDA sanitizer does (``torch/cuda/_sanitizer.py``): an argument whose schema alias
info says *write* is written; one with alias info that is not a write (a view) or any argument
of a factory (``new_*``, ``*_like``) is metadata only; every other tensor argument is read; a
result is written unless it is a view (and a result with no alias info is a fresh
allocation, made on the current stream). Storages are tracked by identity (one
:class:`Record` per ``UntypedStorage``, per allocation): who allocated it on which stream, its
last write and, per stream, its last read since that write.

The checks, each a :class:`~virtual_streams.Violation` naming the op, the buffer, both streams
and flatshard's line:

- **read**: the last write must happen before it (same stream, or joined since);
- **write**: the last write and every read since must happen before it;
- **free** (the caching allocator's rule: freed memory is reused at once by the stream that
  allocated it, or after the streams named by ``record_stream``): every access to the buffer
  from another stream must happen before the allocating stream's present (joined with the
  ``record_stream`` streams' presents). Frees are seen through ``UntypedStorage.resize_``
  (flatshard's way to free a full buffer; ``nccl_semantics`` patches it) and through the
  storage's deallocation (a ``weakref.finalize`` on the storage: storages keep their PyObject
  while C++ holds them, so it fires at the C++ free, checked on torch 2.13).

Collectives are recorded by ``nccl_semantics`` (:func:`collective`): their inputs read and their
outputs written on the collective's own stream, at issue; ``Work.wait()`` joins the current
stream with it (:func:`joined`) and only then drops the tensors the work held.
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import threading
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from flatshard.testing import functional_collectives
from flatshard.testing._clocks import WORLD, Violation, VStream, join

_FACTORY = re.compile(r"(new_.*|.*_like)")  # the sanitizer's: their inputs give only metadata
_MAX_VIOLATIONS = 200


@dataclass
class Access:
    stream: VStream
    epoch: int
    op: str
    site: str

    def __str__(self) -> str:
        return f"{self.op} on {self.stream} at {self.site}"


@dataclass
class Record:
    """One allocation of one storage: who made it, and its accesses since."""

    label: str
    alloc: VStream
    write: Access | None = None
    reads: dict[int, Access] = field(default_factory=dict)  # stream id -> last read
    recorded: list[VStream] = field(default_factory=list)  # record_stream
    finalizer: weakref.finalize | None = None

    def accesses(self) -> list[Access]:
        return [a for a in (self.write, *self.reads.values()) if a is not None]


@dataclass
class _Table:
    records: dict[int, Record] = field(default_factory=dict)  # id(storage) -> record
    numbers: itertools.count = field(default_factory=lambda: itertools.count(1))
    seen: set = field(default_factory=set)  # violation keys already reported


_TABLE = _Table()


def reset() -> None:
    for record in _TABLE.records.values():
        if record.finalizer is not None:
            record.finalizer.detach()
    _TABLE.records.clear()
    _TABLE.numbers = itertools.count(1)
    _TABLE.seen.clear()


# ---- records ---------------------------------------------------------------------------------
def _storage(t: torch.Tensor):
    if t.device.type == "meta" or t.layout is not torch.strided:
        return None
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError, TypeError):
        return None


def _new_record(storage, alloc: VStream, how: str, nbytes: int | None = None) -> Record:
    nbytes = storage.nbytes() if nbytes is None else nbytes
    label = f"buffer #{next(_TABLE.numbers)} ({nbytes} bytes, {how})"
    record = Record(label, alloc)
    old = _TABLE.records.get(id(storage))
    if old is not None and old.finalizer is not None:
        old.finalizer.detach()
    record.finalizer = weakref.finalize(storage, _deallocated, id(storage), record)
    record.finalizer.atexit = False
    _TABLE.records[id(storage)] = record
    return record


def _record(storage) -> Record:
    """The storage's record; one made before any access seen (before the session, or in C++
    out of the mode's sight) counts as allocated on the compute stream before everything."""
    record = _TABLE.records.get(id(storage))
    if record is None:
        record = _new_record(storage, WORLD.compute, "allocated before it was first seen")
    return record


def allocated(storage, op: str, at: str, nbytes: int | None = None) -> Record:
    """A fresh allocation on the current stream (the caching allocator ties it there)."""
    stream = WORLD.current
    return _new_record(storage, stream, f"allocated on {stream} by {op} at {at}", nbytes)


# ---- the checks ------------------------------------------------------------------------------
def _violate(kind: str, key: tuple, message: str) -> None:
    if key in _TABLE.seen or len(WORLD.violations) >= _MAX_VIOLATIONS:
        return
    _TABLE.seen.add(key)
    WORLD.violations.append(Violation(kind, message))


def _check(kind: str, record: Record, now: Access, priors: list[Access]) -> None:
    for prior in priors:
        if not now.stream.after(prior.stream.id, prior.epoch):
            verb = "wrote" if prior is record.write else "read"
            _violate(
                kind,
                (kind, now.op, now.site, prior.op, prior.site),
                f"{kind}: {now.op} on {now.stream} at {now.site} {kind}s {record.label} that "
                f"{prior.op} on {prior.stream} {verb} at {prior.site}, and {now.stream} is not "
                f"ordered after it (no wait_stream / event / Work.wait() between them)",
            )


def read(storage, now: Access) -> None:
    record = _record(storage)
    if record.write is not None:
        _check("read", record, now, [record.write])
    record.reads[now.stream.id] = now


def write(storage, now: Access) -> None:
    record = _record(storage)
    _check("write", record, now, record.accesses())
    record.write, record.reads = now, {}


def _check_free(record: Record, how: str, at: str) -> None:
    reuse = dict(record.alloc.clock)
    for stream in record.recorded:
        join(reuse, stream.clock)
    for prior in record.accesses():
        if prior.stream is record.alloc or reuse.get(prior.stream.id, 0) >= prior.epoch:
            continue
        _violate(
            "free",
            ("free", how, at, prior.op, prior.site),
            f"free: {record.label} was freed ({how}) at {at} while {prior.op} on "
            f"{prior.stream} (at {prior.site}) may still use it: the caching allocator hands "
            f"it to {record.alloc}, its allocating stream, which is not ordered after "
            f"{prior.stream} (wait for it on {record.alloc}, hold the buffer until then, or "
            f"record_stream)",
        )


def _deallocated(key: int, record: Record) -> None:
    if not WORLD.active:
        return
    if _TABLE.records.get(key) is record:
        del _TABLE.records[key]
    _check_free(record, "its last reference dropped", _free_site())


def resized(storage, nbytes: int) -> None:
    """``UntypedStorage.resize_`` (called before it runs): a free of the old bytes, then an
    allocation on the current stream."""
    if not WORLD.active or WORLD.paused:
        return
    at = _free_site()
    record = _TABLE.records.get(id(storage))
    if record is not None and storage.nbytes() > 0:
        _check_free(record, f"resize_({nbytes})", at)
    allocated(storage, f"resize_({nbytes})", at, nbytes)


def record_stream(tensor: torch.Tensor, stream: VStream) -> None:
    """``tensor.record_stream(stream)``: the allocator waits for ``stream`` before reuse."""
    storage = _storage(tensor)
    if storage is not None and WORLD.active:
        _record(storage).recorded.append(stream)


def collective(op: str, inputs: list, outputs: list, at: str) -> VStream | None:
    """A collective issued now from the current stream: its own stream, which reads
    ``inputs`` and writes ``outputs`` (checked against what came before)."""
    if not WORLD.active:
        return None
    stream = WORLD.collective_stream(op)
    now = Access(stream, stream.tick(), op, at)
    outs = {id(s) for s in map(_storage, outputs) if s is not None}
    for t in inputs:
        storage = _storage(t)
        if storage is not None and id(storage) not in outs:
            read(storage, now)
    for storage in {id(s): s for s in map(_storage, outputs) if s is not None}.values():
        write(storage, now)
    return stream


def joined(stream: VStream | None) -> None:
    """``Work.wait()``: the current stream waits for the collective's end."""
    if stream is not None and WORLD.active:
        join(WORLD.current.clock, stream.clock)


# ---- the dispatch mode -----------------------------------------------------------------------
class AccessMode(TorchDispatchMode):
    """Records every aten op's reads and writes on the current virtual stream."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let Dynamo compile under this mode (it skips frames while a mode that says False
        is on the stack: compiled blocks would run eagerly, or fail under ``fullgraph=True``).
        The mode is off while Dynamo traces and on while the compiled artifact runs: an
        ``aot_eager`` graph runs aten ops one by one, which the mode records as it does
        eager ones; an inductor kernel is opaque to it (its accesses are not recorded; a read
        before a wait still shows through the poisoned outputs of ``nccl_semantics``)."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if functional_collectives.handles(func):  # DTensor's: no C++ backend to run them
            return functional_collectives.dispatch(func, args, kwargs)
        # The backend's own threads (Gloo's workers inherit the mode with torch's thread-local
        # state) run its scratch copies, not the program.
        if WORLD.paused or not WORLD.active or threading.get_ident() != WORLD.thread:
            return func(*args, **kwargs)
        schema = func._schema
        factory = bool(_FACTORY.match(schema.name.split("::")[-1]))
        reads, writes = {}, {}
        for argument, value in _arguments(schema, args, kwargs):
            info = argument.alias_info
            is_write = info is not None and info.is_write
            if not is_write and (factory or info is not None):
                continue
            for t in _tensors(value):
                (writes if is_write else reads)[id(t)] = t
        out = func(*args, **kwargs)
        stream, op = WORLD.current, str(func.overloadpacket.__name__)
        now = Access(stream, stream.tick(), op, _site())
        fresh = _outputs(schema, out, writes)
        for storage in fresh:
            if id(storage) not in _TABLE.records or _dead(storage):
                allocated(storage, op, now.site)
        written = {id(s): s for s in map(_storage, writes.values()) if s is not None}
        for storage in {id(s): s for s in map(_storage, reads.values()) if s is not None}.values():
            if id(storage) not in written:
                read(storage, now)
        for storage in written.values():
            write(storage, now)
        return out


def _dead(storage) -> bool:
    record = _TABLE.records.get(id(storage))
    return record is not None and record.finalizer is not None and not record.finalizer.alive


def _outputs(schema, out, writes: dict) -> list:
    """Results that are written (not views) into ``writes``; those with no alias info are
    fresh allocations (returned)."""
    returns = schema.returns
    values = out if len(returns) > 1 and isinstance(out, (tuple, list)) else (out,)
    fresh = []
    for ret, value in zip(returns, values, strict=False):
        info = ret.alias_info
        if info is not None and not info.is_write:
            continue  # a view
        for t in _tensors(value):
            writes[id(t)] = t
            if info is None and (storage := _storage(t)) is not None:
                fresh.append(storage)
    return fresh


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _arguments(schema, args, kwargs):
    yield from zip(schema.arguments[: len(args)], args, strict=False)
    named = {a.name: a for a in schema.arguments[len(args) :]}
    for name, value in kwargs.items():
        if name in named:
            yield named[name], value


# Frames that are nobody's line: torch, the standard library (weakref's finalizers), this package.
_LIBRARIES = (os.path.dirname(torch.__file__), os.path.dirname(os.__file__),
              os.path.dirname(os.path.dirname(__file__)) + "/testing")  # fmt: skip
_KIND: dict = {}  # code object -> "flatshard" / "comm" / "other" (a cache; not flatshard's)


def _kind(code) -> str:
    kind = _KIND.get(code)
    if kind is None:
        name = code.co_filename
        inside = "/flatshard/" in name and "/flatshard/testing/" not in name
        kind = ("comm" if "/flatshard/comm/" in name else "flatshard") if inside else "other"
        _KIND[code] = kind
    return kind


def _where(frame) -> str:
    return f"{frame.f_code.co_filename.rsplit('/src/', 1)[-1]}:{frame.f_lineno}"


def _site() -> str:
    """flatshard's line: its innermost frame (and, when that is in ``comm/``, the first one
    outside it: the feature that asked); else the innermost frame outside torch."""
    frame, found, fallback = sys._getframe(2), [], None
    while frame is not None:
        kind = _kind(frame.f_code)
        if kind != "other":
            found.append(_where(frame))
            if kind == "flatshard":
                break
        elif fallback is None and not frame.f_code.co_filename.startswith(_LIBRARIES):
            fallback = _where(frame).rsplit("/", 1)[-1]
        frame = frame.f_back
    if found:
        return " <- ".join(found[:2])
    return fallback or "?"


def _free_site() -> str:
    return _site()


def _record_fresh(tensor: torch.Tensor, op: str) -> None:
    """A functional collective's result: allocated on the current stream (its C++ kernel
    allocates it there), while a session is open."""
    if WORLD.active:
        allocated(tensor.untyped_storage(), op, _site())


functional_collectives.record_fresh = _record_fresh
