"""``fs.shard``: turn a module into a fully sharded one, in place.

The steps, each owned elsewhere: the arguments are checked (``core/options.py``), the strategy
and mesh become a ``Topology`` (``core/mesh.py``), the policy a wrap plan (``wrap.py``); the
ranks of the mesh agree on all of it (``comm/fingerprint.py``); the units and their state are
built (``core/build.py``); the parameters become fragments (``core/params.py``) and the hooks go
on (``core/hooks.py``), their handles kept in the model's state. ``fs.unshard``
(``core/teardown.py``) undoes all of it.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from flatshard.coalesce import Coalesce
from flatshard.comm import watchdog
from flatshard.comm.fingerprint import check_ranks_agree
from flatshard.core import hooks
from flatshard.core.build import build_state, describe, wrap_plan
from flatshard.core.mesh import require_initialized, resolve_topology
from flatshard.core.meta_init import InitFn
from flatshard.core.options import parse_options
from flatshard.core.params import tag_fragments
from flatshard.core.state import STATE_ATTR, ShardedState, get_state  # noqa: F401 (re-exported)
from flatshard.core.strategy import ShardingStrategy
from flatshard.core.switches import Switches
from flatshard.offload import CPUOffload
from flatshard.optim.guard import guard_optimizers
from flatshard.parallel.tensor import data_parallel_mesh, tp_groups
from flatshard.precision import Comm, MixedPrecision
from flatshard.prefetch import Prefetch
from flatshard.wrap import Policy

__all__ = ["ShardingStrategy", "get_state", "shard"]


def shard(
    model: nn.Module,
    *,
    policy: Policy | None = None,
    strategy: str | ShardingStrategy = "full_shard",
    mixed_precision: MixedPrecision | None = None,
    offload: CPUOffload | None = None,
    mesh: DeviceMesh | dist.ProcessGroup | None = None,
    timeout_s: float | None = None,
    init_fn: InitFn | None = None,
    prefetch: Prefetch | None = None,
    reshard_root: bool = False,
    coalesce: Coalesce | bool | None = None,
    split_root: bool = True,
    comm: Comm | None = None,
) -> nn.Module:
    """Shard ``model``'s parameters over ``mesh`` (default: all ranks) and return it.

    ``policy`` picks the modules that become units (``fs.wrap.by_type``, ``fs.wrap.by_size`` or
    any ``callable(module) -> bool``; default ``fs.wrap.auto()``: the repeated block class;
    ``fs.wrap.root_only()`` for one unit); the rest belongs to the root unit. After this call
    ``model.named_parameters()`` yields, under the original names, this rank's 1-D fragment of
    every parameter: build the optimizer afterwards. Every collective of the model runs on the
    ranks of ``mesh`` only (a 1-D mesh or group; a 2-D (replicate, shard) mesh for
    ``hybrid_shard``). The other arguments are documented field by field on
    ``flatshard.core.options.ShardOptions``: ``strategy``, ``mixed_precision``, ``offload``,
    ``timeout_s``, ``init_fn`` (a model built under ``torch.device("meta")`` is materialised
    unit by unit), ``prefetch``, ``reshard_root``, ``coalesce``, ``split_root``, ``comm``. The
    ``FLATSHARD_*`` switches are read here, once (``core/switches.py``). ``fs.unshard(model)``
    gives the plain module back.
    """
    options = parse_options(
        model, strategy, mixed_precision, offload, timeout_s, init_fn, prefetch, reshard_root,
        coalesce, split_root, comm,
    )  # fmt: skip
    require_initialized()
    topology = resolve_topology(options.strategy, data_parallel_mesh(model, mesh))
    plan = wrap_plan(model, policy)
    switches = Switches.from_environ()
    check_ranks_agree([*switches.describe(), *describe(model, plan, options)], topology.mesh_group)
    watchdog.adopt(switches.watchdog, options.timeout.total_seconds())  # after: same on all
    tp = tp_groups(model, topology)  # before build_state replaces the DTensor parameters
    state = build_state(model, plan, topology, switches, options)
    state.tp = tp
    tag_fragments(state)
    guard_optimizers()
    state.handles += hooks.register_hooks(state)  # kept: fs.unshard removes them
    if mixed_precision is not None:
        state.handles += hooks.register_precision_casts(model, mixed_precision)
    setattr(model, STATE_ATTR, state)
    return model
