"""``fs.no_sync``: gradient accumulation over micro-batches.

Two ways to accumulate, with opposite trade-offs:

``keep="unsharded"`` (default, fastest)
    Inside the block, each unit keeps its full flat gradient after backward and the next
    micro-batch adds into it; nothing is communicated. The first backward outside the block
    reduce-scatters the sum once. Costs one full-size gradient buffer per unit (the whole
    model's gradients, as DDP) until then.
``keep="sharded"`` (bounded memory)
    Every micro-batch is reduce-scattered as usual and added into the sharded ``.grad``:
    gradient memory stays at 1/world of the model, communication is paid per micro-batch.

Either way the result equals one backward over all micro-batches; dividing the loss by the
number of micro-batches stays the user's job, as in PyTorch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from flatshard.core.state import StateMode, get_state

KEEP_MODES = ("unsharded", "sharded")


@contextmanager
def no_sync(model: nn.Module, *, keep: str = "unsharded") -> Iterator[None]:
    """Accumulate gradients of the backward passes inside the block (see the module doc)."""
    if keep not in KEEP_MODES:
        raise ValueError(f"no_sync(keep={keep!r}): choose 'unsharded' (fast) or 'sharded' (lean)")
    state = get_state(model)
    if state.mode is StateMode.ACCUMULATE:
        raise ValueError("fs.no_sync is already active for this model; do not nest it")
    previous = state.mode
    if keep == "unsharded":  # keep="sharded" reduces every micro-batch: nothing changes
        state.mode = StateMode.ACCUMULATE
    try:
        yield
    finally:
        state.mode = previous
