"""torch's functional collectives on a ``strict_async`` group, under virtual streams.

DTensor moves data with functional collectives (``torch.ops._c10d_functional``: a
redistribution's all-gather, a ``Partial`` placement's reduce-scatter or all-reduce), and
their C++ kernels call the group's backend for the tensor's device. ``strict_async`` is a
Python ``ProcessGroup`` with no C++ backend (c10d cannot hold a Python one), so these kernels
fail on it ("No backend type associated with device type cpu"). Inside a
``virtual_streams.session()``, ``stream_access.AccessMode`` hands every ``_c10d_functional`` op
to :func:`dispatch` instead, which runs it as ProcessGroupNCCL runs it in eager mode:

- the result is allocated on the current stream, and the collective is issued through the
  group's own (checked) method: on its own stream, ordered after the issuing one, the result
  poisoned until its wait;
- the work is registered with c10d's registry of functional collectives (as the C++ kernel
  does), so ``wait_tensor`` - from DTensor's ``AsyncCollectiveTensor``, which calls it
  below any dispatch mode - waits for it: the current stream joins the collective's end
  (the ``Work.wait()`` rule), and the work drops the tensors it held.

So tensor parallelism (DTensor) runs on the device path's backend with every access checked,
exactly as flatshard's own collectives are. An op it does not carry raises, naming the op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN,
               "max": dist.ReduceOp.MAX, "product": dist.ReduceOp.PRODUCT}  # fmt: skip


# Set by ``stream_access`` (which imports this module, not the reverse): records a result as a
# fresh allocation on the current virtual stream while a session is open.
record_fresh: Callable[[torch.Tensor, str], None] | None = None


def handles(func) -> bool:
    """``func`` is a functional collective (or its wait)."""
    return func.namespace == "_c10d_functional"


def dispatch(func, args: tuple, kwargs: dict):
    """Run the functional collective ``func`` on its strict_async group; see the module."""
    name = func.overloadpacket.__name__
    handler = _HANDLERS.get(name)
    if handler is None and name.startswith(("all_", "reduce", "broadcast")):
        raise NotImplementedError(
            f"flatshard.testing: the functional collective {func} is not carried on a "
            "strict_async group; add it to testing/functional_collectives.py"
        )
    if handler is None:  # not a collective (e.g. ``_wrap_tensor_autograd``)
        return func(*args, **kwargs)
    return handler(*args, **kwargs)


class _Carried(TorchDispatchMode):
    """Only the functional collectives, outside a virtual-streams session."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if handles(func):
            return dispatch(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


@contextmanager
def carried() -> Iterator[None]:
    """Run DTensor's functional collectives on strict_async groups outside a
    ``virtual_streams.session()`` (which carries them itself)."""
    with _Carried():
        yield


def _group(group_name) -> dist.ProcessGroup:
    group = group_name if isinstance(group_name, dist.ProcessGroup) else None
    return group if group is not None else _resolve_process_group(group_name)


def _fresh(like: torch.Tensor, shape: list[int], op: str) -> torch.Tensor:
    """A result, allocated on the current stream (as the C++ kernel allocates it)."""
    out = like.new_empty(shape)
    if record_fresh is not None:
        record_fresh(out, op)
    return out


class _ThenDivide(dist.Work):
    """Gloo has no average: the sum, divided by ``divide`` once it has arrived."""

    def __init__(self, work: dist.Work, out: torch.Tensor, divide: int) -> None:
        super().__init__()
        self._work, self._out, self._divide = work, out, divide

    def wait(self, timeout=None) -> bool:
        if self._work is not None:
            self._work.wait()
            self._out.div_(self._divide)
            self._work = None
        return True


def _pending(out: torch.Tensor, work: dist.Work, divide: int = 1) -> torch.Tensor:
    """Register ``work`` for ``out``: c10d's ``wait_tensor(out)`` will wait for it."""
    if divide != 1:
        work = _ThenDivide(work, out, divide)
    torch._C._distributed_c10d._register_work(out, work)
    return out


def _all_gather(input: torch.Tensor, group_size: int, group_name) -> torch.Tensor:
    input = input.contiguous()
    out = _fresh(input, [input.shape[0] * group_size, *input.shape[1:]], "all_gather")
    return _pending(out, _group(group_name).all_gather_single(out, input))


def _reduce_scatter(input: torch.Tensor, reduce_op: str, group_size: int, group_name):
    input = input.contiguous()
    out = _fresh(input, [input.shape[0] // group_size, *input.shape[1:]], "reduce_scatter")
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = _REDUCE_OPS[reduce_op.lower()]
    work = _group(group_name).reduce_scatter_single(out, input, opts)
    return _pending(out, work, group_size if reduce_op.lower() == "avg" else 1)


def _all_reduce(input: torch.Tensor, reduce_op: str, group_name) -> torch.Tensor:
    out = _fresh(input, list(input.shape), "all_reduce")
    out.copy_(input)
    group = _group(group_name)
    work = group.allreduce([out], _REDUCE_OPS[reduce_op.lower()])
    return _pending(out, work, group.size() if reduce_op.lower() == "avg" else 1)


def _all_to_all(input: torch.Tensor, output_split_sizes, input_split_sizes, group_name):
    input = input.contiguous()
    rows = sum(output_split_sizes) if output_split_sizes else input.shape[0]
    out = _fresh(input, [rows, *input.shape[1:]], "all_to_all")
    group = _group(group_name)
    work = group.all_to_all_single(out, input, list(output_split_sizes),
                                   list(input_split_sizes))  # fmt: skip
    return _pending(out, work)


_HANDLERS = {
    "all_gather_into_tensor": _all_gather,
    "reduce_scatter_tensor": _reduce_scatter,
    "all_reduce": _all_reduce,
    "all_to_all_single": _all_to_all,
}
