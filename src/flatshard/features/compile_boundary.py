"""Where ``torch.compile`` stops: flatshard's hooks run eagerly, whatever the user compiled.

[Note: hooks the compiler never traces]
The invariant: *no frame of flatshard's engine is ever traced by Dynamo*. A compiled graph sees
a unit's parameters only as the full-shape views the pre-forward hook installed (graph inputs,
like any module parameter), never a collective, a ``Work.wait``, a storage resize, the
``UnitViews`` node, ``queue_callback`` or the engine's Python state. Everything that crosses
from a module's call into the engine is therefore wrapped in ``torch.compiler.disable(fn,
recursive=True)`` (``untraced``), as FSDP2 wraps its own (``_fsdp_common._dynamo_disable``):

* the forward pre- and post-hooks of every unit (``hooks.register_hooks``), and the root's
  mixed-precision casts (``hooks.register_precision_casts``);
* the resolvers of the root's placeholders (``lazy_root.OnDemand``), whose
  ``__torch_function__`` Dynamo does trace when a compiled forward reads one.

The gradient hooks (pre-backward on unit outputs, ``UnitViews.backward``, the final callback)
run in the autograd engine, which ``torch.compile`` does not trace; compiled autograd
(``torch._dynamo.compiled_autograd``) would, and is not supported.

What each way of compiling then gives (torch 2.13, checked in tests/test_compile.py):

* ``block.compile(...)`` / ``torch.compile(block)`` on a unit, before or after ``fs.shard``:
  the compiled entry point is ``nn.Module._call_impl``, a torch-internal frame Dynamo skips
  (``eval_frame`` deliberately leaves ``_call_impl`` unwrapped), so hooks and ``forward``
  run as frames of their own: the disabled hooks run eagerly, ``forward`` is one graph. Zero
  graph breaks, also under ``fullgraph=True``.
* ``torch.compile(model)``: Dynamo inlines each unit's ``_call_impl`` into the parent's graph
  and meets a disabled hook: one graph break per hook (a unit boundary) and nothing else. A
  break inside a loop (``for block in self.blocks``) makes Dynamo run that whole frame
  eagerly and compile the blocks' forwards one by one: the same graphs as per-block compile.

Without the wrapper Dynamo traces into the hooks, and fails (``fullgraph=True``) or breaks
the graph at every unsupported call inside them (dozens per step, and recompiles on every
unit object it guards). ``torch.compiler.disable(fn, recursive=True)`` and Dynamo's skipping
of a compiled ``_call_impl`` frame are older than torch 2.13, flatshard's minimum (the version
tested). A Dynamo that traced ``_call_impl`` itself would stop at a hook with its own error
under ``fullgraph=True`` ("Skip calling `torch.compiler.disable()`d function") and break the
graph there, once per hook, without it: the hooks are never traced either way.

Parameter names: ``block.compile()`` changes no name. ``torch.compile(block)`` puts an
``OptimizedModule`` in the tree, and torch names its parameters ``..._orig_mod....``;
``plain_name`` removes that component, and the sharded root's state-dict hooks (installed by
``register_plain_keys``) give ``model.state_dict()`` — hence ``fs.full_state_dict`` and
checkpoints — the plain model's keys, and accept them back in ``model.load_state_dict``.

[Note: async tensors at a compiled unit's door]
A ``ParallelStyle`` redistributes its outputs with ``async_op=True`` and hands them on with
``to_local()``: an ``AsyncCollectiveTensor`` (ACT), a tensor subclass that waits for its
collective at first use. An ACT that enters a compiled frame as an *input* loses its
gradient (torch 2.13, CPU, ``aot_eager``, ``fullgraph`` on or off): the compiled graph gives
it none. This is torch's, without flatshard: ``torch.compile(f)(x)`` with ``x =
DTensor.from_local(t, mesh, [Partial()]).redistribute(mesh, [Replicate()],
async_op=True).to_local()`` does not even require grad. In a per-block-compiled TP
transformer the first block's input is the rowwise embedding's ACT output: the embedding's
eager ``Redistribute.backward`` then gets autograd's plain zeros for the missing gradient
(``'Tensor' object has no attribute '_local_tensor'``; TP alone, no sharding, fails so), and
FSDP2 + TP compiled the same way trains silently wrong (1e-2 off in float64).

For models with TP parameters flatshard adds one untraced forward pre-hook to each unit
(``register_settling``; registered at ``fs.shard``, after the plan's own hooks): an ACT
argument is waited for and replaced by the plain tensor it wraps through ``_Settled``, an
identity autograd function (no copy; the gradient passes through unchanged, as the ACT's
would). Eager runs are unchanged: their first op would wait anyway. It covers what enters a
unit; an ACT made by eager code and fed to a compiled module that is not a unit still loses
its gradient (compile units, or settle it as ``_settle_inputs`` does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

F = TypeVar("F", bound=Callable[..., Any])

COMPILED_WRAPPER = "_orig_mod"  # the attribute torch.compile's OptimizedModule keeps its module in


def untraced(fn: F) -> F:
    """``fn`` as a function Dynamo never traces: called from a compiled frame it runs eagerly
    (a graph break there, or none when the frame around it is already skipped)."""
    return torch.compiler.disable(fn, recursive=True)


class _Settled(torch.autograd.Function):
    """An ``AsyncCollectiveTensor`` as the plain tensor it wraps, waited for; differentiable
    (identity), no copy."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        elem = tensor.trigger_wait()
        return elem.view_as(elem)  # a fresh tensor object: autograd writes its metadata on it

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


def _settle_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    """Forward pre-hook: every ``AsyncCollectiveTensor`` among the call's arguments settled."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.utils._pytree import tree_flatten, tree_map_only

    if not any(isinstance(t, AsyncCollectiveTensor) for t in tree_flatten((args, kwargs))[0]):
        return None
    return tree_map_only(AsyncCollectiveTensor, _Settled.apply, (args, kwargs))


def register_settling(modules: list[nn.Module]) -> list[Any]:
    """The pre-hook of [Note: async tensors at a compiled unit's door] on each of ``modules``
    (after their hooks so far: the TP plan's input preparation runs first)."""
    hook = untraced(_settle_inputs)
    return [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]


def is_untraced(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is wrapped by ``untraced`` (Dynamo's marker on disabled functions)."""
    return bool(getattr(fn, "_torchdynamo_disable", False))


def plain_name(name: str) -> str:
    """``name`` without the ``_orig_mod`` components ``torch.compile(module)`` adds."""
    if COMPILED_WRAPPER not in name:
        return name
    return ".".join(part for part in name.split(".") if part != COMPILED_WRAPPER)


def register_plain_keys(root: nn.Module) -> list[Any]:
    """State-dict hooks on the sharded root: its ``state_dict()`` keys are the plain model's
    (no ``_orig_mod.``), and ``load_state_dict`` takes plain keys (and compiled ones)."""
    post = root.register_state_dict_post_hook(_strip_compiled_keys)
    pre = root.register_load_state_dict_pre_hook(_add_compiled_keys)
    return [post, pre]


def _strip_compiled_keys(module: nn.Module, state_dict: dict, prefix: str, meta: Any) -> None:
    # In place and in order: the caller returns this very dict. ``_metadata`` keeps the tree's
    # own names: torch's ``load_state_dict`` looks it up by them.
    if not any(COMPILED_WRAPPER in key for key in state_dict):
        return
    items = list(state_dict.items())
    state_dict.clear()
    for key, value in items:
        if key.startswith(prefix):  # (only this module's entries: not a parent's)
            key = prefix + plain_name(key[len(prefix) :])
        state_dict[key] = value


def _add_compiled_keys(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """Plain keys back to the module tree's own names (``..._orig_mod...``), in place."""
    actual = {prefix + plain_name(k): prefix + k for k in _own_keys(module)}
    for key in [k for k in state_dict if k in actual and actual[k] != k]:
        state_dict[actual[key]] = state_dict.pop(key)


def _own_keys(module: nn.Module) -> list[str]:
    """The module tree's state-dict keys, without running the state-dict hooks."""
    keys = [n for n, _ in module.named_parameters(remove_duplicate=False)]
    keys += [n for n, _ in module.named_buffers(remove_duplicate=False)]
    return [k for k in keys if COMPILED_WRAPPER in k]
