"""Buckets of coalesced units: several small unit modules made one unit at ``fs.shard``.

[Note: coalesced units]
A bucket is a run of units that follow each other in the modules' order, chosen at
``fs.shard`` (``plan_for``, from ``fs.Coalesce``) and checked against the first forward. Its
members are then rebuilt as **one** ``Unit`` over several modules (``merge_buckets``, as
FSDP2's ``fully_shard([a, b])``): one ``FlatGroup`` per (dtype, requires_grad) over every
member's parameters, so one layout, one shard, one full buffer, one state machine, one
all-gather and one reduce-scatter per group through the plain
``Unit.start_gather`` / ``Unit.start_reduce`` (no staging copy, no chunked gradient copy).
A reduce-scatter SUM is elementwise, so the other layout gives the same bits as the members
reduced apart.

* **Forward pass** (``hooks.py``; ``Unit.forward_pass``). Every member module has the unit's
  pre/post-forward hooks. The first member call of a pass gathers, prefetches and installs
  every member's views; the first call *with grad* that finds no counted ``UnitViews`` node
  for the pass makes one (a member under a reentrant checkpoint runs under ``no_grad``: the
  next member still gets autograd-connected views). The pass ends once every member ran and
  no member call is in progress (members may nest: a unit and its child unit can share a
  bucket; ``members.end_call``), and the unit is then released by the post-forward every unit
  shares, under the same rule as a plain unit (see [Note: one post-forward] in ``hooks.py``);
  a member that does not run leaves the unit gathered until its post-backward. A member call
  that runs again before the pass ended starts a new pass.
* **Backward.** The node's outputs are every member's views, so it runs once, after the
  backward of the first member (in forward order) that used them: that is the reduction
  point. A member call whose output does not lead to the node (a reentrant checkpoint inside
  it) adds a post-backward on its inputs, as a plain unit's call does; the pass's node counts
  only if some member's output leads to it. A member whose forward ran under ``no_grad`` (a
  reentrant checkpoint around it) is recomputed later in backward with its own counted node:
  until it has been, the unit's reduction waits (``Unit.nograd_members``, see
  ``members.defer_to_reentrant``).
* **Memory.** The full buffer is private (never the gather pool's): its storage is resized to
  zero on release and back for the next gather, so autograd's saved views of it stay valid
  without saved-tensor hooks, and the full-shape views of its many small parameters are
  built once, not once per pooled buffer (per step that was most of the tiny-unit overhead:
  100 units of 50k parameters, 1.67x -> 1.42x unsharded, session 12).
* Each member keeps its entry in ``fs.units`` (its own ``index``, ``full_bytes`` and
  parameters; ``bucket``: the bucket's index), so plans and tests read as before.
  ``Coalesce.unit_bytes`` keeps the units whose gather would hold the most memory apart.
"""

from __future__ import annotations

import torch

from flatshard.coalesce import Coalesce
from flatshard.core.unit import Member, Unit
from flatshard.offload import CPUOffload
from flatshard.precision import MixedPrecision


def merge_buckets(
    units: list[Unit],
    buckets: list[list[Unit]],
    built_from: dict[int, list],
    slots: dict,
    mixed_precision: MixedPrecision | None,
    offload: CPUOffload | None,
) -> list[Unit]:
    """``units`` with each bucket's members replaced by one unit over all their parameters
    (at the place of its first member in ``units``; its index is the bucket's first's)."""
    where = {id(u): b for b in buckets for u in b}
    out: list[Unit] = []
    done: set[int] = set()
    for unit in units:
        bucket = where.get(id(unit))
        if bucket is None:
            out.append(unit)
        elif id(bucket[0]) not in done:
            done.add(id(bucket[0]))
            index = buckets.index(bucket)
            out.append(_merged(bucket, index, built_from, slots, mixed_precision, offload))
    for position, unit in enumerate(out):  # fragment tags index ShardedState.units
        unit.index = position
    return out


def _merged(
    bucket: list[Unit], index: int, built_from: dict[int, list], slots: dict, mp, offload
) -> Unit:
    first = bucket[0]
    members = [
        Member(u.module, u.index, gathered_bytes(u), frozenset(id(p) for p in built_from[id(u)]))
        for u in bucket
    ]
    params = [p for u in bucket for p in built_from[id(u)]]
    unit = Unit(
        first.index, first.module, params, slots, topology=first.topology, stats=first.stats,
        reshard_after_forward=first.reshard_after_forward,
        mixed_precision=mp, offload=offload, members=members,
    )  # fmt: skip
    unit.bucket = index
    return unit


def coalescible(unit: Unit, root: torch.nn.Module) -> bool:
    """May ``unit`` share collectives? Not the root (gathered around every other unit's
    forward), and only sharded groups (no_shard has nothing to gather)."""
    if unit.topology.divide_by is not None:  # on its own mesh: see [Note: per-unit meshes]
        return False
    return unit.module is not root and all(
        not g.replicated and unit.process_group is not None for g in unit.groups
    )


def gathered_bytes(unit: Unit) -> int:
    return sum(g.padded_numel * g.compute_dtype.itemsize for g in unit.groups)


def plan_buckets(order: list[Unit], config: Coalesce, root: torch.nn.Module) -> list[list[Unit]]:
    """Automatic buckets: maximal runs of consecutive coalescible units of at most
    ``unit_bytes`` each (in ``order``: the modules' order, see ``module_order``), cut where the
    run would exceed ``bucket_bytes``; runs of one unit stay alone."""
    runs: list[list[Unit]] = [[]]
    total = 0
    for unit in order:
        size = gathered_bytes(unit)
        small = coalescible(unit, root) and size <= config.unit_bytes
        if not small or total + size > config.bucket_bytes:
            runs.append([])
            total = 0
        if small:
            runs[-1].append(unit)
            total += size
    return [run for run in runs if len(run) > 1]


def module_order(units: list[Unit], root: torch.nn.Module) -> list[Unit]:
    """``units`` in the order of their modules in ``root.modules()`` (a parent before its
    children, siblings in registration order: the order a forward usually runs them)."""
    rank = {id(m): i for i, m in enumerate(root.modules())}
    return sorted(units, key=lambda u: (rank[id(u.module)], u.is_tail))


def bucket_order_message(unit: Unit, ran: list[tuple[Unit, int]]) -> str:
    """The warning when a bucket's members did not run one after another in the forward
    (``ran``: (unit, member) in the order of their first calls)."""
    names = [f"{type(m.module).__name__}#{m.index}" for m in unit.members]
    order = [f"{type(u.members[i].module).__name__}#{u.members[i].index}" for u, i in ran]
    return (
        f"flatshard: bucket {unit.bucket} ({', '.join(names)}) was planned at fs.shard from "
        f"the modules' order, but its units did not run one after another in the first "
        f"forward (forward order: {', '.join(order[:12])}{' ...' if len(order) > 12 else ''}). "
        "Results are unaffected, but the bucket holds its members' gathered parameters "
        "longer than needed. Pass fs.shard(..., coalesce=fs.Coalesce(buckets=[[names of "
        "modules that run one after another], ...])) or coalesce=False."
    )


def plan_for(config: Coalesce, units: list[Unit], root: torch.nn.Module) -> list[list[Unit]]:
    """The buckets of ``fs.shard``: the explicit ones, or automatic in module order."""
    if config.buckets is not None:
        names = {id(m): n for n, m in root.named_modules()}
        return named_buckets(config, units, names, root)
    if not config.enabled:
        return []
    return plan_buckets(module_order(units, root), config, root)


def named_buckets(
    config: Coalesce, units: list[Unit], names: dict[int, str], root: torch.nn.Module
) -> list[list[Unit]]:
    """``config.buckets`` resolved to units; ``ValueError`` for a name that is not a unit."""
    by_name = {names[id(u.module)]: u for u in units}
    resolved = []
    for bucket in config.buckets or ():
        members = []
        for name in bucket:
            unit = by_name.get(name)
            if unit is None or not coalescible(unit, root):
                why = "is the root" if unit is not None else "is not a unit of this model"
                raise ValueError(
                    f"Coalesce(buckets=...): {name!r} {why}; name modules the policy made "
                    f"units (fs.units(model) lists them): {sorted(n for n in by_name if n)}"
                )
            members.append(unit)
        resolved.append(members)
    return resolved
