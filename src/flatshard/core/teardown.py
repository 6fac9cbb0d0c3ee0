"""``fs.unshard``: a sharded model back to the plain module it was (``fs.shard`` undone).

[Note: what fs.shard leaves on a model]
``fs.shard`` changes a model in four places, and ``fs.unshard`` undoes each:
- its parameters: every place of a parameter holds this rank's 1-D fragment (``Unit.slots``);
  they get one new full ``nn.Parameter`` per original parameter (tied places share it),
  gathered from the shards as they are stored (the fp32 masters under mixed precision,
  core/masters.py), on the model's compute device;
- its hooks: forward hooks on every unit module, state-dict hooks on the root, casts under
  mixed precision, methods made by ``fs.register_method``; their handles are kept in the
  state (``ShardedState.handles``) and removed;
- the wrappers of ``fs.checkpoint_activations`` (``features/activation_checkpoint.py``):
  each module's own ``forward`` comes back;
- its attributes: the state (``STATE_ATTR``) and the checkpoint session.
Buffers stay where ``fs.shard`` put them (the compute device, ``buffer_dtype`` under mixed
precision). Gradients and optimizer state are not carried over: the optimizer stepped the
fragments, so build a new one for the plain parameters (or call ``fs.shard`` again first).
"""

from __future__ import annotations

import torch
from torch import nn

from flatshard.core.masters import master_views
from flatshard.core.state import STATE_ATTR, ShardedState, StateMode, get_state
from flatshard.features import activation_checkpoint
from flatshard.parallel.unit_mesh import refuse_unit_meshes

__all__ = ["unshard"]


@torch.no_grad()
def unshard(model: nn.Module) -> nn.Module:
    """Undo ``fs.shard``: ``model`` with its full parameters (the original names and shapes,
    on the model's device), no flatshard hooks, wrappers or attributes, and returned.

    Every rank of the model's mesh must call it (it gathers), between steps. The optimizer
    of the sharded model steps fragments that are gone: build a new one. ``fs.shard`` may be
    called on the result again."""
    state = get_state(model)
    _check_unshardable(model, state)
    _end_checkpoint_session(model)
    state.reshard_all()
    full = _full_parameters(state)
    for handle in reversed(state.handles):
        handle.remove()
    state.handles.clear()
    for unit in state.units:
        for slot in unit.slots:
            fragment = unit.groups[slot.group].specs[slot.index].fragment
            # A place whose parameter the user replaced after fs.shard keeps the new one.
            if slot.module._parameters.get(slot.name) is fragment:
                slot.module._parameters[slot.name] = full[(unit.index, slot.group, slot.index)]
    _undo_checkpoint_activations(model)
    del model.__dict__[STATE_ATTR]
    return model


def _check_unshardable(model: nn.Module, state: ShardedState) -> None:
    if state.mode is not StateMode.TRAIN:
        raise ValueError(
            f"fs.unshard({type(model).__name__}) called inside {state.mode.value!r} "
            "(summon_full_params, no_sync or pipeline_step); call it after the block, between "
            "steps"
        )
    if state.tp is not None:
        raise NotImplementedError(
            "fs.unshard does not support tensor-parallel parameters yet (they would come back "
            "as DTensors); read them with fs.full_state_dict instead"
        )
    refuse_unit_meshes(state, "fs.unshard")


def _end_checkpoint_session(model: nn.Module) -> None:
    """Wait for an async ``fs.save`` in flight (it reads the shards) and drop the session."""
    from flatshard.checkpoint.saver import SESSION_ATTR  # DCP: loaded only by what saved

    session = model.__dict__.pop(SESSION_ATTR, None)
    if session is not None:
        session.wait_pending()


def _full_parameters(state: ShardedState) -> dict[tuple[int, int, int], nn.Parameter]:
    """One new full parameter per (unit, group, parameter) of ``state``, in its stored dtype."""
    full: dict[tuple[int, int, int], nn.Parameter] = {}
    for unit in state.units:
        with master_views(state, unit) as views:
            for gi, group in enumerate(unit.groups):
                for pi, view in enumerate(views[gi]):
                    whole = view.detach().clone()
                    full[(unit.index, gi, pi)] = nn.Parameter(whole, group.requires_grad)
    return full


def _undo_checkpoint_activations(model: nn.Module) -> None:
    """Each module wrapped by ``fs.checkpoint_activations`` gets its own ``forward`` back."""
    for module in model.modules():
        if not module.__dict__.pop(activation_checkpoint.MARK, False):
            continue
        wrapper = module.__dict__.get("forward")
        if getattr(wrapper, "func", None) is not activation_checkpoint._checkpointed_forward:
            continue  # someone wrapped it again since: leave their forward alone
        original = wrapper.args[0]
        if getattr(original, "__func__", None) is type(module).forward:
            del module.forward  # the class's method, as before
        else:
            module.forward = original  # an instance forward set before the wrapping
