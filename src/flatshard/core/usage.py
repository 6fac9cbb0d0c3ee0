"""Which parameters get a gradient: the ranks agree on usage at the end of each backward.

[Note: how usage is agreed]
A parameter that no call of this backward used on this rank has no local gradient; if another
rank used it, the reduction still brings every rank its average, and every rank must hand it
out (or none may: ``.grad`` stays ``None`` where no rank used it, as in one process). So the
ranks agree on a flag per parameter: used on any rank. How depends on the backend:

* **Gloo** (the host path): the flags are host tensors, all-reduced (MAX) over the model's
  host groups, blocking, after the reductions are waited. Gloo waits on the host anyway.
* **A device backend** (NCCL; ``strict_async`` on the CPU): the flags go to the compute device
  (a device-side fill when this rank used everything, else one non-blocking copy from pinned
  memory) and are all-reduced (MAX) *asynchronously* over the model's mesh group, issued right
  after the last reduction and waited with the same stream-ordered ``wait()``. The host reads
  them back (a sync) only where this rank has a parameter it did not use
  (``read_agreed_usage``): a rank that used a parameter knows it gets a gradient, and every
  rank that did not use it reads the same agreed flag, so the decision is the same on every
  rank. A model whose every rank uses every parameter (dense models) makes no host sync and
  no host collective; a step in which some rank left a parameter unused (an unused branch, an
  MoE expert that got no token) costs that rank one read, as DDP's
  ``find_unused_parameters=True`` reads its map (docs/engine.md, "How usage is agreed").

The flags' order is the order of the reductions (the same on every rank: every rank reduces
the same groups in the same order), one per parameter of each group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from flatshard.comm.collectives import CommStats, PendingWork, all_reduce, waits_on_host
from flatshard.core.mesh import Topology

USAGE_OP = "usage_all_reduce"


@dataclass
class UsageAgreement:
    """The agreement of one backward: this rank's masks, and (device path) the flags in
    flight. ``used()`` gives, per mask, the parameters to hand a gradient."""

    masks: list[torch.Tensor]  # host bool, one per reduction: used on this rank
    topology: Topology
    stats: CommStats
    flags: torch.Tensor | None = None  # device path: this rank's flags, agreed once waited
    work: PendingWork | None = None

    def used(self, timeout) -> list[list[bool]]:
        """Per mask, whether each parameter was used on some rank (waits for the flags)."""
        local = [m.tolist() for m in self.masks]
        if self.flags is None:  # the host path
            return _split(_host_agreement(self.masks, self.topology, self.stats), local)
        if self.work is not None:
            self.work.wait(timeout)  # stream-ordered on a device backend
            self.work = None
        if all(all(m) for m in local):  # this rank used everything: nothing to read
            return local
        return _split(read_agreed_usage(self.flags), local)


def start_agreement(
    masks: list[torch.Tensor], topology: Topology, stats: CommStats
) -> UsageAgreement:
    """Start agreeing on ``masks`` (see the Note): on a device backend the flags' all-reduce
    is issued now, asynchronously; on Gloo nothing happens until ``used``."""
    agreement = UsageAgreement(masks, topology, stats)
    group = topology.mesh_group
    if not masks or waits_on_host(group) or dist.get_world_size(group) == 1:
        return agreement  # (alone: the host path agrees with no one, at no cost)
    flags = agreement.flags = _device_flags(torch.cat(masks), topology.device)
    stats.record(USAGE_OP, flags, group, USAGE_OP)
    work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True)
    agreement.work = PendingWork(work, USAGE_OP, (flags,), label=USAGE_OP, group=group)
    return agreement


def _device_flags(local: torch.Tensor, device: torch.device) -> torch.Tensor:
    """This rank's flags as int32 on ``device``, without waiting for it: a fill when every
    parameter was used, else a non-blocking copy (from pinned memory on CUDA)."""
    if bool(local.all()):  # a host tensor: no sync
        return torch.ones(local.numel(), dtype=torch.int32, device=device)
    host = local.to(torch.int32)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def read_agreed_usage(flags: torch.Tensor) -> list[bool]:
    """The agreed flags on the host: the one host read of the device path, made only by a
    rank with a parameter it did not use (counted apart by the tests' ``HostSyncs``)."""
    return [bool(v) for v in flags.tolist()]


def _host_agreement(masks: list[torch.Tensor], topology: Topology, stats) -> list[bool]:
    """The Gloo path: one blocking MAX all-reduce of host flags per host group."""
    flags = torch.cat(masks).to(dtype=torch.int32)
    for group in topology.host_groups:  # shard then replicate: every rank
        all_reduce(flags, group, stats, op=dist.ReduceOp.MAX, name=USAGE_OP)
    return [bool(v) for v in flags.tolist()]


def _split(agreed: list[bool], local: list[list[bool]]) -> list[list[bool]]:
    """``agreed`` cut per mask, or-ed with this rank's own use (one pass: no slice per mask)."""
    theirs = iter(agreed)
    # zip takes ``mask`` first: it stops at the mask's end without drawing from ``theirs``
    out = [[mine or other for mine, other in zip(mask, theirs, strict=False)] for mask in local]
    assert next(theirs, None) is None, "more flags than parameters"
    return out
