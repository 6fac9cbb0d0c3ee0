"""A virtual compute device on the CPU: tells host (offloaded) tensors from compute-device ones.

Why: on a CPU run flatshard's compute device *is* the host, so ``tensor.device`` cannot show
that an offloaded tensor reached a collective (ProcessGroupNCCL refuses CPU tensors: "No backend
type associated with device type cpu"). Under :class:`VirtualDevice` the compute device is
``COMPUTE = torch.device("cpu", 0)`` (patch ``flatshard.core.mesh.compute_device`` to return
it) and every storage carries a tag, ``host`` or ``compute``, kept the way CUDA keeps devices:

- a factory call's result is on its ``device=`` (no device: the host, torch's default);
- ``.to(device)`` / ``.to(other)`` / ``.cpu()`` / ``.cuda()`` move (a copy when the tag
  changes, none when it does not, as on CUDA); ``*_like`` and ``new_*`` follow their input;
- any other op's fresh result is on its inputs' device, and an op mixing host and compute
  tensors (other than 0-dim host scalars, which CUDA accepts) is recorded in ``mixed``
  (CUDA would raise); ``copy_``/``__setitem__`` may cross, as on CUDA;
- ``tensor.device`` answers ``COMPUTE`` for compute tensors and ``cpu`` for host ones, so
  flatshard's own ``device=x.device`` / ``x.device != device`` logic runs as on a GPU;
- tensors made in C++ where the mode cannot see them (autograd's gradients, ``deepcopy``)
  count as compute: host tensors only come from explicit host allocations and transfers.

``host_collective_check`` plugs into ``nccl_semantics.add_tensor_check``: a host tensor handed
to a collective is a violation naming the op and flatshard's line.
"""

from __future__ import annotations

import sys
import weakref

import torch
from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
from torch.autograd.graph import _engine_run_backward
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

COMPUTE = torch.device("cpu", 0)
HOST, DEV = "host", "compute"
_CROSSING = {"copy_", "__setitem__", "__getitem__", "to", "cpu", "cuda"}  # may mix devices
_HOST_READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__"}  # a sync


def _classify(device) -> str | None:
    """host / compute / None (meta: no storage to track)."""
    device = torch.device(device) if isinstance(device, (str, int)) else device
    if device.type == "meta":
        return None
    return DEV if device.type == "cuda" or device.index is not None else HOST


class VirtualDevice(TorchFunctionMode):
    """Enter around everything a test case runs (model building included); see the module."""

    def __init__(self) -> None:
        super().__init__()
        self._tags: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storage -> tag
        self.mixed: list[str] = []
        # Reads of compute-device values on the host from flatshard's code (``.item()``,
        # ``.tolist()``, ``bool()``, a move to the host): each one a device sync on CUDA.
        self.syncs: list[str] = []

    # ---- tags ----------------------------------------------------------------------------
    def tag(self, t: torch.Tensor) -> str:
        storage = _storage(t)
        return DEV if storage is None else self._tags.get(storage, DEV)

    def put(self, tensor: torch.Tensor, tag: str | None) -> torch.Tensor:
        """Place ``tensor`` on ``tag``'s side (tests: the batches they feed a model)."""
        if tag is not None and tensor.device.type != "meta":
            self._tags[tensor.untyped_storage()] = tag
        return tensor

    def host_collective_check(self, op: str, t: torch.Tensor) -> str | None:
        if self.tag(t) == HOST and not _in_object_collective():
            return f"a host tensor ({tuple(t.shape)}, {t.dtype}) was handed to {op}"
        return None

    # ---- the mode ------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == torch.Tensor.device.__get__:
            return COMPUTE if self.tag(args[0]) == DEV else torch.device("cpu")
        if func in (torch.Tensor.backward, torch.autograd.backward):
            with self:  # the engine runs flatshard's hooks: keep the mode on for them
                return _backward(func, args, kwargs)
        name = getattr(func, "__name__", "")
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        target = self._target(name, args, kwargs)
        self._note_sync(name, args, target)
        if name in ("to", "cpu", "cuda") and args and isinstance(args[0], torch.Tensor):
            return self._move(args[0], name, args, kwargs, target)
        self._check_mixed(name, inputs)
        out = func(*args, **_plain_devices(kwargs))
        self._tag_fresh(out, inputs, target or self._inferred(inputs))
        return out

    def _note_sync(self, name: str, args, target: str | None) -> None:
        """A host read of a compute tensor in flatshard's code: a sync on CUDA."""
        if not args or not isinstance(args[0], torch.Tensor) or self.tag(args[0]) != DEV:
            return
        reads = name in _HOST_READS or (name in ("to", "cpu") and target == HOST)
        site = _flatshard_site() if reads else "?"
        if site != "?":
            self.syncs.append(f"{name} at {site}")

    def _target(self, name: str, args, kwargs) -> str | None:
        if kwargs.get("device") is not None:
            return _classify(kwargs["device"])
        if name == "cpu":
            return HOST
        if name == "cuda":
            return DEV
        if name == "to":
            for a in args[1:]:
                if isinstance(a, (torch.device, str)):
                    return _classify(a)
                if isinstance(a, torch.Tensor):
                    return self.tag(a)
        return None

    def _move(self, t: torch.Tensor, name: str, args, kwargs, target) -> torch.Tensor:
        """``.to``/``.cpu``/``.cuda``: a real copy when the side changes, none otherwise."""
        target = target or self.tag(t)
        rest = {k: v for k, v in kwargs.items() if k not in ("device", "memory_format")}
        dtype = next((a for a in args[1:] if isinstance(a, torch.dtype)), rest.pop("dtype", None))
        rest.pop("copy", None)
        crossing = target != self.tag(t)
        if not crossing and (dtype is None or dtype == t.dtype):
            return t
        out = t.to(dtype=dtype or t.dtype, copy=True, **rest)
        return self.put(out, target)

    def _check_mixed(self, name: str, inputs: list) -> None:
        if name in _CROSSING or len(inputs) < 2:
            return
        sides = {self.tag(t) for t in inputs if not (t.dim() == 0 and self.tag(t) == HOST)}
        if len(sides) > 1:
            self.mixed.append(f"{name} at {_flatshard_site()}")

    def _inferred(self, inputs: list) -> str:
        """A fresh result's side: compute if any input that CUDA would place is there (0-dim
        host tensors are scalars that follow the others), else the host (factories too)."""
        placed = {self.tag(t) for t in inputs if t.dim() > 0 or self.tag(t) == DEV}
        return DEV if DEV in placed else HOST

    def _tag_fresh(self, out, inputs: list, tag: str) -> None:
        """Tag outputs whose storage is new (views and in-place results keep theirs)."""
        seen = {id(s) for s in map(_storage, inputs) if s is not None}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = _storage(t)
                if storage is not None and id(storage) not in seen:
                    self._tags[storage] = tag


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError, TypeError):  # wrapper subclasses, meta
        return None


def _plain_devices(kwargs: dict) -> dict:
    """``device=COMPUTE`` as plain ``cpu`` for torch itself (an index on cpu means nothing)."""
    device = kwargs.get("device")
    if device is None or _classify(device) is None:
        return kwargs
    return {**kwargs, "device": torch.device("cpu")}


def _backward(func, args, kwargs) -> None:
    """``Tensor.backward`` / ``torch.autograd.backward`` without their torch-function check
    (it would hand the call back to the mode forever); ``inputs=`` is not supported."""
    if kwargs.get("inputs") is not None:
        raise NotImplementedError("VirtualDevice: backward(inputs=...)")
    tensors = args[0]
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    grad = args[1] if len(args) > 1 else kwargs.get("gradient", kwargs.get("grad_tensors"))
    create = kwargs.get("create_graph", args[3] if len(args) > 3 else False)
    retain = kwargs.get("retain_graph", args[2] if len(args) > 2 else None)
    grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(grad, len(tensors)), False)
    retain = create if retain is None else retain
    _engine_run_backward(tensors, grads, retain, create, (), allow_unreachable=True,
                         accumulate_grad=True)  # fmt: skip


# torch's object collectives put their tensors on the group's object device themselves (the
# current CUDA device under NCCL; the CPU here, where the group registers no device).
_OBJECT_COLLECTIVES = {
    "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
    "send_object_list", "recv_object_list",
}  # fmt: skip


def _in_object_collective() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if (
            frame.f_code.co_name in _OBJECT_COLLECTIVES
            and "distributed" in frame.f_code.co_filename
        ):
            return True
        frame = frame.f_back
    return False


def _flatshard_site() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/flatshard/" in name and "/flatshard/testing/" not in name:
            return f"{name.rsplit('/src/', 1)[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"
