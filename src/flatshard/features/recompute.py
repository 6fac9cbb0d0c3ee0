"""Forward calls that happen during backward: activation-checkpoint recomputation, any route.

[Note: recomputation]
Users checkpoint activations in many ways (``torch.utils.checkpoint`` with or without
reentrant autograd, around a unit or inside its forward; torch's composable ``checkpoint``;
``CheckpointWrapper``; Hugging Face's ``gradient_checkpointing_enable``; ``fs.checkpoint_
activations``). They differ in two things that matter to a sharded unit:

* **Whose graph carries the gradients.** A non-reentrant checkpoint recomputes only to refill
  the saved tensors of the first forward's graph; the recomputed graph is thrown away, and the
  gradients reach the first forward's ``UnitViews`` node. A reentrant checkpoint runs the first
  forward under ``no_grad`` and backpropagates the *recomputed* graph in a nested backward.
* **Whether our hooks see the recomputation.** Around a unit (``checkpoint(block, x)``), the
  recomputation calls the unit's ``__call__`` again, during backward; inside a unit's forward
  (``checkpoint(self.mlp, x)``, Hugging Face layers) it fires no hook of ours.

What flatshard does, uniformly:

* Every pre-backward gathers the unit and installs *recompute views*: outputs of an uncounted
  ``UnitViews`` node. A recomputation inside the unit's forward reads those; under a reentrant
  checkpoint the nested backward reaches that node, which adds its gradients to the unit's.
* A forward call during backward (``classify_call``) is a ``RECOMPUTE`` when the unit still
  waits for a node of this step's forward (non-reentrant: only the views are needed, no node,
  no reshard, no output hooks) and ``REENTRANT`` otherwise (its graph is the one that will be
  backpropagated: a counted node, kept gathered into that nested backward).
* When a forward call's output does not depend on its node at all (a reentrant checkpoint
  inside the unit ran every use of the views under ``no_grad``), the node would never run: a
  hook on the call's inputs, whose gradients are complete only once the nested backward is
  over, stands in as that call's post-backward (``post_backward_on_inputs``).

The recompute of a unit never regathers it: the pre-backward (or the recomputing forward
itself) gathers once, and the unit stays gathered until its post-backward.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten

if TYPE_CHECKING:
    from flatshard.core.unit import Unit


class CallKind(enum.Enum):
    FORWARD = "forward"  # an ordinary forward (with or without grad)
    RECOMPUTE = "recompute"  # in backward, refilling the saved tensors of the first forward
    REENTRANT = "reentrant"  # in backward, building the graph a nested backward will use


@dataclass
class Call:
    """One forward call of a unit in progress (``Unit.calls`` is the stack of them)."""

    kind: CallKind
    node: Any = None  # its counted UnitViews node, if it made one
    views: Any = None  # the root's tail: its views, made at their first use (see hooks.py)
    grad_enabled: bool = True  # the root's tail: the grad mode its forward call began in


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass (a forward now = recomputation)."""
    return torch._C._current_graph_task_id() != -1


def classify_call(unit: Unit) -> CallKind:
    """What a forward call of ``unit`` starting now is (see the Note)."""
    if not in_backward():
        return CallKind.FORWARD
    if unit.grad.pending_nodes > 0 or not torch.is_grad_enabled():
        return CallKind.RECOMPUTE
    return CallKind.REENTRANT


RECHECK_EVERY = 16  # see output_reaches


def output_reaches(unit: Unit, output: Any, node: Any) -> bool:
    """:func:`reaches`, walked only every ``RECHECK_EVERY``-th call once it held twice in a
    row for this unit (the walk costs ~0.1 ms a call). Skipping it where it would have failed
    (checkpointing turned on mid-run) costs no correctness: the node never runs, so the end of
    backward reduces the unit (``finish_backward``), with the recomputed gradients; it is only
    later, and the unit stays gathered until then, until the next walk notices."""
    unit.reach_calls += 1
    if unit.reach_streak >= 2 and unit.reach_calls % RECHECK_EVERY:
        return True
    found = reaches(output, node)
    unit.reach_streak = unit.reach_streak + 1 if found else 0
    return found


def reaches(output: Any, node: Any) -> bool:
    """Does the autograd graph of ``output`` lead to ``node``? The walk skips nodes created
    before ``node`` (sequence numbers grow along a forward), so it stays inside the unit."""
    first = node._sequence_nr()
    stack = [t.grad_fn for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
    seen: set[int] = set()
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        if fn is node:
            return True
        seen.add(id(fn))
        if fn._sequence_nr() >= first:
            stack.extend(f for f, _ in fn.next_functions)
    return False


def post_backward_on_inputs(inputs: Any, done: Callable[[], None]) -> list[torch.Tensor]:
    """Call ``done()`` once the gradients of every input tensor that requires grad are
    complete; returns those tensors. Without any nothing is registered: the end-of-backward
    callback then reduces the unit."""
    tensors = [
        t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    if tensors:
        torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: done(), mode="all")
    return tensors
