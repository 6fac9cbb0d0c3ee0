"""``fs.save``/``fs.load`` of the error-feedback residuals (``fs.Comm(error_feedback=True)``).

The residuals live in ``features/error_feedback.py``; how they are made topology-free is
[Note: error-feedback residuals in checkpoints] there. Here: ``checkpoint_items`` (saver.py)
writes each rank's pieces of the owed correction ``M`` under ``KEY_PREFIX + <parameter name>``,
sharded like the parameters; ``load_targets`` and ``restore_loaded`` (loader.py) read them
back at any world size and rebuild every rank's residuals.
"""

from __future__ import annotations

import torch
from torch import nn

from flatshard.comm.collectives import CommStats, all_reduce_sum, reduce_scatter_sum
from flatshard.core.reduce import data_parallel_world, divisor
from flatshard.core.state import get_state
from flatshard.features.error_feedback import Residuals

KEY_PREFIX = "flatshard.error_feedback/"


def _groups(model: nn.Module):
    """(state, unit, group) for every trainable flat group, in the same order on every rank."""
    state = get_state(model)
    for unit in state.units:
        for group in unit.groups:
            if group.requires_grad:
                yield state, unit, group


def residuals_of(model: nn.Module) -> Residuals | None:
    return get_state(model).stats.residuals


def _factors(topo) -> tuple[int, int]:
    """(the divisor of a reduced gradient, the number of replicas of each shard)."""
    return divisor(topo), data_parallel_world(topo) // topo.shard_world


def mean_shards(model: nn.Module, names: dict[int, str]) -> dict[str, torch.Tensor]:
    """This rank's fragment-shaped pieces of ``M`` (sum of the ranks' residuals / divisor),
    by parameter name (``names``: fragment id -> name). Collective over the model's ranks."""
    residuals, out = residuals_of(model), {}
    stats = CommStats()  # not the model's: a save must not show in fs.comm_stats
    for state, unit, group in _groups(model):
        topo = unit.topology
        full = residuals.of(group).clone()
        shard = torch.empty(group.shard_numel, dtype=torch.float32, device=full.device)
        if topo.shard_group is None:
            shard.copy_(full)
        else:
            reduce_scatter_sum(shard, full, topo.shard_group, stats).wait(state.timeout)
        if topo.replicate_group is not None:
            all_reduce_sum(shard, topo.replicate_group, stats).wait(state.timeout)
        shard.div_(_factors(topo)[0])
        for spec in group.specs:
            if id(spec.fragment) in names:
                out[names[id(spec.fragment)]] = shard[spec.local_start : spec.local_end]
    return out


def restore_residuals(model: nn.Module, names: dict[int, str], loaded: dict) -> None:
    """Each rank's residuals from ``M``'s loaded pieces (``loaded``: name -> fragment-shaped
    tensor; names absent: zero)."""
    residuals = residuals_of(model)
    for _, unit, group in _groups(model):
        d, replicas = _factors(unit.topology)
        residual = residuals.of(group)
        residual.zero_()
        base = group.shard_numel * (group.rank if unit.topology.shard_group is not None else 0)
        for spec in group.specs:
            piece = loaded.get(names.get(id(spec.fragment)))
            if piece is not None and piece.numel():
                own = residual[base + spec.local_start : base + spec.local_end]
                own.copy_(piece.view(-1).to(own.device) * (d / replicas))


def checkpoint_items(models: list[nn.Module], layout, in_parts: bool) -> dict:
    """``fs.save``'s items for the residuals (``M``'s pieces, sharded like the parameters;
    none without error feedback). Collective: every rank of the model calls it."""
    if not any(has_feedback(m) for m in models):
        return {}
    if in_parts:
        raise ValueError(
            "fs.save(across=...): pipeline stages with fs.Comm(error_feedback=True) cannot be "
            "checkpointed yet (the residuals are per stage); save without across=, or train the "
            "pipeline with error_feedback=False"
        )
    shards = mean_shards(models[0], layout.name_of)
    return {KEY_PREFIX + n: layout.params[n].item(piece) for n, piece in shards.items()}


def load_targets(models: list[nn.Module], layout, saved_keys, in_parts: bool) -> dict:
    """``fs.load``'s targets for the residuals the checkpoint holds (``saved_keys``), by
    parameter name; empty for a model without error feedback (the residual is ignored)."""
    if not any(has_feedback(m) for m in models):
        return {}
    if in_parts:
        raise ValueError(
            "fs.load(across=...): pipeline stages with fs.Comm(error_feedback=True) cannot "
            "load residuals yet; load without across=, or use error_feedback=False"
        )
    return {
        KEY_PREFIX + n: p.item(torch.zeros_like(p.fragment, dtype=torch.float32).detach())
        for n, p in layout.params.items()
        if KEY_PREFIX + n in saved_keys
    }


def restore_loaded(models: list[nn.Module], layout, targets: dict) -> None:
    """After ``fs.load`` read ``targets``: every rank's residuals (zero where none was saved)."""
    if not any(has_feedback(m) for m in models):
        return
    loaded = {key[len(KEY_PREFIX) :]: item.local for key, item in targets.items()}
    restore_residuals(models[0], layout.name_of, loaded)


def has_feedback(model: nn.Module) -> bool:
    return residuals_of(model) is not None
