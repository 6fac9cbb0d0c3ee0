"""Small object collectives so that a failure on one rank is raised on every rank (no hang).

Checkpoints involve every rank of the model's mesh, as ``fs.full_state_dict`` does: with
replication (``hybrid_shard``, ``no_shard``) the shard group alone does not reach the replicas,
and DCP needs every writer in one plan. So they run over ``Topology.mesh_group`` (every rank of
the mesh, see core/mesh.py), never over the default group: a model that is one stage of a
pipeline, or one of two models of a job, saves and loads without the other ranks.
"""

from __future__ import annotations

import pickle

import torch.distributed as dist
from torch import nn


def model_group(model: nn.Module) -> dist.ProcessGroup:
    """The group ``model``'s checkpoints run over: every rank of its mesh (module docstring)."""
    from flatshard.core.state import get_state

    state = get_state(model)
    # With tensor parallelism every tp rank writes its own blocks: the plan spans dp x tp.
    return state.topology.mesh_group if state.tp is None else state.tp.model_group


def first_error(error: str | None, group: dist.ProcessGroup | None) -> str | None:
    """Every rank's ``error`` -> the first one (prefixed with its rank), the same on all ranks."""
    if group is None or dist.get_world_size(group) == 1:
        return error
    errors: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    for rank, err in enumerate(errors):
        if err is not None:
            return f"[rank {dist.get_global_rank(group, rank)}] {err}"
    return None


def from_rank0(value, group: dist.ProcessGroup | None):
    """Rank 0's ``value`` on every rank of ``group``."""
    if group is None or dist.get_world_size(group) == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def raise_if(error: str | None, exc_type: type[Exception] = ValueError) -> None:
    if error is not None:
        rank = dist.get_rank() if dist.is_initialized() else 0  # world: names this process
        raise exc_type(f"[flatshard rank {rank}] {error}")


def dcp_error(err: BaseException, what: str) -> Exception:
    """A short, actionable exception for DCP's ``CheckpointException`` (a ``BaseException``
    carrying every failed rank's traceback)."""
    failures = getattr(err, "failures", None) or {}
    causes = [exc for exc, _ in failures.values()] or [err]
    for exc in causes:
        if isinstance(exc, pickle.UnpicklingError):
            reason = next((line for line in str(exc).splitlines() if "GLOBAL" in line), "")
            return ValueError(
                f"refusing to load {what}: a tensor entry is a pickle of something other than "
                f"a tensor, which torch.load(weights_only=True) blocked. {reason}".strip()
            )
    first = causes[0]
    message = f"{what} failed on rank(s) {sorted(failures)}: {type(first).__name__}: {first}"
    return OSError(message) if isinstance(first, OSError) else RuntimeError(message)
