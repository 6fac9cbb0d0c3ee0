"""Real collectives at world 1, counted, and delayed: the tools of ``bench/gpu_check.py``.

At world 1 ``resolve_topology`` drops the shard group (a group of one is ``None``) and
flatshard issues no collective at all. ``forced_groups()`` keeps it: the size-one group of the
1-D mesh becomes the shard group (``full_shard``, ``shard_grad_op``) or the replicate group
(``no_shard``), so every gather is an in-place all-gather, every reduction a reduce-scatter
and every agreement an all-reduce on it (NCCL on a GPU, Gloo in the dry run), as at world N.
On CUDA that also puts them on the engine's side streams (core/streams.py), which a plain
world-1 run never enters. ``Spy`` counts what reaches the backend (by op and device) and can
delay each collective (``torch.cuda._sleep``): on the stream it is issued from (``current``:
the engine's gather or reduce stream), or on a fresh side stream that it is then issued from
(``side``: everything else goes on, only the collective lands late). On the CPU a delay is a
host sleep.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import Counter

import torch
import torch.distributed as dist
from gpu_check_common import Ctx, lm_loss

import flatshard as fs
import flatshard.api as fs_api
import flatshard.comm.collectives as fs_coll
import flatshard.core.mesh as fs_mesh
from flatshard.core.strategy import STRATEGIES, MeshRole

FORCED_WHAT = (
    "fs.shard at world 1 with the size-one group kept (flatshard.core.mesh.resolve_topology "
    "and flatshard.api.resolve_topology patched): the 1-D mesh's group becomes the shard group "
    "(full_shard, shard_grad_op; replicate group for no_shard), shard_world 1, so every gather "
    "is an in-place all-gather, every reduction a reduce-scatter and every agreement an "
    "all-reduce on that group; host (Gloo) groups are made for it as at world N. Every unit "
    "gathers, fp32 ones too (their shard is their full buffer: an in-place all-gather of it), "
    "and units that are cast or offloaded are coalesced into buckets (fs.Coalesce) as at "
    "world N; Spy counts, per check, the collectives that reached the backend"
)

# torch-level names (2.13 has the *_single ones; 2.11 the *_into_tensor/_tensor ones) and the
# references flatshard took at import (comm/collectives.py); each counted once per call.
_TORCH_OPS = {
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
}
_FLATSHARD_OPS = {"_all_gather_tensor": "all_gather", "_reduce_scatter_tensor": "reduce_scatter"}


def _keep_size_one(topo: fs_mesh.Topology, strategy) -> fs_mesh.Topology:
    roles = STRATEGIES[fs_api.ShardingStrategy(strategy)].dims
    group = topo.mesh_group
    if len(roles) != 1 or dist.get_world_size(group) != 1:
        return topo  # only the dropped group of one is put back
    shard, replicate = topo.shard_group, topo.replicate_group
    if roles[0] is MeshRole.SHARD:
        shard = group
    else:
        replicate = group
    hosts = tuple(fs_mesh._host_group(g, topo.made) for g in (shard, replicate) if g is not None)
    return dataclasses.replace(
        topo, shard_group=shard, replicate_group=replicate, shard_rank=0, shard_world=1,
        host_groups=hosts,
    )  # fmt: skip


@contextlib.contextmanager
def forced_groups():
    """``fs.shard`` inside keeps the size-one group (see the module's docstring)."""
    original = fs_mesh.resolve_topology

    def resolve(strategy, mesh):
        return _keep_size_one(original(strategy, mesh), strategy)

    fs_mesh.resolve_topology = fs_api.resolve_topology = resolve
    try:
        yield
    finally:
        fs_mesh.resolve_topology = fs_api.resolve_topology = original


def cycles_per_ms() -> float:
    """``torch.cuda._sleep`` cycles per millisecond on this GPU (the most of 3 readings)."""
    best = 0.0
    for _ in range(3):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        torch.cuda._sleep(1_000_000)
        end.record()
        end.synchronize()
        best = max(best, 1_000_000 / start.elapsed_time(end))
    return best


@dataclasses.dataclass
class Delay:
    """Delay each collective by ``ms`` before it is issued; ``where``: ``current`` (sleep on the
    stream it is issued from) or ``side`` (issue it from a side stream that sleeps first). On
    the CPU (the dry run) a host sleep before the call; host (Gloo) groups of a GPU run are
    not delayed."""

    ms: float
    where: str = "current"
    cuda: bool = False
    cycles: int = 0
    side: torch.cuda.Stream | None = None

    def prepare(self, cuda: bool) -> None:
        self.cuda = cuda
        if cuda:
            self.cycles = int(self.ms * cycles_per_ms())
            self.side = torch.cuda.Stream() if self.where == "side" else None

    def issue(self, fn, args, kwargs):
        if not self.cuda:
            time.sleep(self.ms / 1e3)
            return fn(*args, **kwargs)
        if not args[0].is_cuda:
            return fn(*args, **kwargs)
        if self.side is None:
            torch.cuda._sleep(self.cycles)
            return fn(*args, **kwargs)
        issuing = torch.cuda.current_stream()
        self.side.wait_stream(issuing)  # the inputs are ready; only the collective is late
        with torch.cuda.stream(self.side):
            torch.cuda._sleep(self.cycles)
            out = fn(*args, **kwargs)
        if not kwargs.get("async_op", False):  # a blocking op: its caller reads it next
            issuing.wait_stream(self.side)
        return out


class Spy:
    """Counts every collective that reaches torch.distributed (``op:device``), optionally
    delaying each (``Delay``); a context manager that patches and restores."""

    def __init__(self, delay: Delay | None = None) -> None:
        self.calls: Counter = Counter()
        self.delay = delay
        self._local = threading.local()  # nesting depth per thread: count the outermost
        self._saved: list[tuple[object, str, object]] = []

    def _wrap(self, op: str, fn):
        def call(*args, **kwargs):
            local = self._local
            if getattr(local, "depth", 0) or not args or not isinstance(args[0], torch.Tensor):
                return fn(*args, **kwargs)
            local.depth = 1
            try:
                self.calls[f"{op}:{args[0].device.type}"] += 1
                return self.delay.issue(fn, args, kwargs) if self.delay else fn(*args, **kwargs)
            finally:
                local.depth = 0

        return call

    def __enter__(self) -> Spy:
        for module, table in ((dist, _TORCH_OPS), (fs_coll, _FLATSHARD_OPS)):
            for name, op in table.items():
                if hasattr(module, name):
                    fn = getattr(module, name)
                    self._saved.append((module, name, fn))
                    setattr(module, name, self._wrap(op, fn))
        return self

    def __exit__(self, *exc) -> None:
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved.clear()

    def issued(self, device_type: str) -> bool:
        """Did all-gathers and gradient reductions reach the backend on ``device_type``? (A
        reduction is a reduce-scatter; on Gloo, flatshard's is an all-reduce and a copy.)"""
        reductions = self.calls[f"reduce_scatter:{device_type}"]
        reductions += self.calls[f"all_reduce:{device_type}"] if device_type == "cpu" else 0
        return self.calls[f"all_gather:{device_type}"] > 0 and reductions > 0

    def summary(self) -> dict[str, int]:
        return dict(sorted(self.calls.items()))


# ---- the checks of the "forced" section (each gets the Ctx of gpu_check_common) ----------------
MP = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _math_attention():
    """Deterministic attention (SDPA's math kernel): bitwise comparisons of whole runs."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # an old torch: its default kernels
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.MATH])


def _build(c: Ctx, forced: bool, **kwargs) -> torch.nn.Module:
    with forced_groups() if forced else contextlib.nullcontext():
        return c.sharded(**kwargs)


def trajectory(c: Ctx, forced: bool, delay: Delay | None = None, steps: int = 3) -> dict:
    """``steps`` AdamW steps of the bf16 + CPU-offload model (the configuration that moves the
    most: casts, H2D/D2H copies, pooled buffers, buckets): losses, final fragments, calls."""
    model = _build(c, forced, mixed_precision=fs.MixedPrecision(**MP), offload=fs.CPUOffload())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if delay is not None:
        delay.prepare(c.cuda)
    losses = []
    with Spy(delay) as spy, _math_attention():
        for x in [c.x, c.x2, c.x][:steps]:
            loss = lm_loss(model, x)
            loss.backward()
            opt.step(), opt.zero_grad()
            losses.append(loss.detach())
    params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    coalesced = [u.bucket for u in fs.units(model) if u.bucket is not None]
    out = {"losses": [v.item() for v in losses], "params": params, "spy": spy}
    out.update(units=len(fs.units(model)), coalesced_units=len(coalesced))
    return out


def bitwise(a: dict, b: dict) -> dict:
    """Are two trajectories bit-identical? (and the largest difference, to judge a miss)"""
    names = a["params"].keys()
    diff = max((a["params"][n].float() - b["params"][n].float()).abs().max().item() for n in names)
    same = a["losses"] == b["losses"] and all(
        torch.equal(a["params"][n], b["params"][n]) for n in names
    )
    return {"bit_identical": same, "max_param_diff": diff}


def check_forced_vs_plain(c: Ctx) -> dict:
    """Real collectives change no bit: forced == plain world 1 (which issues none)."""
    plain, forced = trajectory(c, False), trajectory(c, True)
    out = bitwise(forced, plain)
    out.update(collectives=forced["spy"].summary(), plain_collectives=plain["spy"].summary())
    out.update(units=forced["units"], coalesced_units=forced["coalesced_units"])
    out["issued"] = forced["spy"].issued(c.device.type)
    out["ok"] = out["bit_identical"] and out["issued"]
    return out


def _check_delay(c: Ctx, where: str, ms: float) -> dict:
    if where == "side" and not c.cuda:
        return {"skipped": "CUDA only: a side stream to issue the collectives from"}
    base, again = trajectory(c, True), trajectory(c, True)
    delayed = trajectory(c, True, Delay(ms if c.cuda else 1.0, where))
    out = bitwise(delayed, base)
    out["baseline_repeatable"] = bitwise(again, base)["bit_identical"]
    out["delay_ms"] = ms if c.cuda else "1 (host sleep: the dry run)"
    out["collectives"] = delayed["spy"].summary()
    out["ok"] = out["bit_identical"] and out["baseline_repeatable"]
    return out


def check_delay_current_stream(c: Ctx) -> dict:
    """Each collective issued after a 20 ms sleep on its issuing stream: bit-identical."""
    return _check_delay(c, "current", 20.0)


def check_delay_side_stream(c: Ctx) -> dict:
    """Each collective issued from a side stream that sleeps 20 ms first (compute runs on):
    bit-identical, so nothing reads a gather or a reduction before its wait."""
    return _check_delay(c, "side", 20.0)


def _offload_run(c: Ctx, forced: bool) -> dict:
    """CPUOffload: 2 AdamW steps with fs.clip_grad_norm_, the full optimizer state, then 2
    steps of fs.optim.Adafactor (the three that handed host tensors to NCCL once)."""
    model = _build(c, forced, offload=fs.CPUOffload())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    norms = []
    with Spy() as spy, _math_attention():
        for x in (c.x, c.x2):
            lm_loss(model, x).backward()
            norms.append(fs.clip_grad_norm_(model, 1.0).item())
            opt.step(), opt.zero_grad()
        osd = fs.full_optimizer_state_dict(model, opt)
        other = _build(c, forced, offload=fs.CPUOffload())
        ada = fs.optim.Adafactor(other.parameters(), lr=1e-2)
        for x in (c.x, c.x2):
            lm_loss(other, x).backward()
            ada.step(), ada.zero_grad()
    state = {f"{n}.{k}": v for n, s in osd["state"].items() for k, v in s.items()}
    state = {k: v for k, v in state.items() if torch.is_tensor(v)}
    params = {n: p.detach().cpu().clone() for n, p in other.named_parameters()}
    return {"norms": norms, "state": state, "params": params, "spy": spy}


def check_offload_collectives(c: Ctx) -> dict:
    """The collectives of offloaded models outside the step (``_offload_run``) run on the
    device and change no bit against plain world 1 (where they are skipped)."""
    plain, forced = _offload_run(c, False), _offload_run(c, True)
    same_state = plain["state"].keys() == forced["state"].keys() and all(
        torch.equal(v.cpu(), forced["state"][k].cpu()) for k, v in plain["state"].items()
    )
    same_ada = all(torch.equal(v, forced["params"][k]) for k, v in plain["params"].items())
    out = {"norms": forced["norms"], "same_norms": plain["norms"] == forced["norms"]}
    out.update(same_optimizer_state=same_state, same_adafactor_params=same_ada)
    out.update(state_tensors=len(plain["state"]), collectives=forced["spy"].summary())
    out["ok"] = (
        out["same_norms"] and same_state and same_ada and forced["spy"].issued(c.device.type)
    )
    return out


FORCED_CHECKS = [check_forced_vs_plain, check_delay_current_stream, check_delay_side_stream]
FORCED_CHECKS += [check_offload_collectives]
