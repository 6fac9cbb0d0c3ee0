"""The root's tail: the root parameters used after the last unit get a unit of their own.

[Note: the root's tail]
The root unit holds what no other unit owns: typically the embeddings (used before the first
block) and the final norm and output head (used after the last). As one unit it is reduced
when its last gradient exists, at the very end of backward, so the head's gradient (the
largest of the model with a big vocabulary) waits through the whole backward, exposed at the
end, and the head's gathered parameters and gradient are held all that time.

``fs.shard(split_root=True)`` (the default) puts the root's *tail* (parameters every place of
which is a module registered after the last unit's modules) in a second unit over the same
root module. Both units gather at the root's pre-forward and stay gathered through the
forward exactly as the root did, so code that touches any parameter anywhere in the root's
forward keeps working. They differ in backward only: the tail's ``UnitViews`` node fires as
soon as the head and final norm have their gradients, so the tail reduces while the blocks
compute their backward, and releases its gathered parameters and flat gradient then.

Parameters shared with earlier modules (a tied embedding and head) stay in the root.
"""

from __future__ import annotations

from torch import nn

from flatshard.parallel.tensor import is_dtensor

# The lazy root (lazy_root.py) saves memory at the loss, and costs a saved-tensor hook on every
# tensor the forward saves; below this size (embeddings of a tiny vocabulary) the root stays
# gathered from forward into backward as before.
LAZY_MIN_BYTES = 1 << 20


def tail_parameters(
    model: nn.Module,
    unit_modules: list[nn.Module],
    root_params: list[nn.Parameter],
    slots: dict[int, list[tuple[nn.Module, str]]],
) -> list[nn.Parameter]:
    """The root's parameters all of whose places come after every other unit's modules (in
    ``model.modules()`` order); empty when that would leave nothing else in the root."""
    position = {id(m): i for i, m in enumerate(model.modules())}
    last_unit = -1
    for unit_module in unit_modules:
        if unit_module is not model:
            last_unit = max(last_unit, *(position[id(m)] for m in unit_module.modules()))
    if last_unit < 0:
        return []
    tail = [
        p
        for p in root_params
        if all(m is not model and position[id(m)] > last_unit for m, _ in slots[id(p)])
    ]
    return tail if len(tail) < len(root_params) else []


def worth_lazy(root_params: list[nn.Parameter]) -> bool:
    """Is the root (its tail split off) big enough to be released after forward? Never with
    tensor-parallel parameters: autograd saves their DTensors, which the lazy root's
    saved-tensor hooks cannot rebuild after the release (see [Note: tensor-parallel
    parameters])."""
    if any(is_dtensor(p) for p in root_params):
        return False
    return sum(p.numel() * p.element_size() for p in root_params) >= LAZY_MIN_BYTES
