"""Measurements of ``bench/gpu_check.py`` that are not parity checks: the versions, the wait
probe (what a timed wait costs the host on this backend) and the sync audit (the device
synchronisations of one steady step, by the flatshard line that caused them).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from gpu_check_common import Ctx, lm_loss
from gpu_check_forced import MP, cycles_per_ms, forced_groups

import flatshard as fs
import flatshard.comm.collectives as fs_coll

ROOT = Path(__file__).resolve().parents[1]
FLATSHARD_DIR = str(Path(fs.__file__).resolve().parent) + os.sep
SYNC_TEXT = "synchronizing CUDA operation"  # torch's set_sync_debug_mode("warn") message


def torch_pin() -> str | None:
    """The torch version CI installs (``.ci/run``), if the checkout has it."""
    try:
        return re.search(r"torch==([\w.]+)", (ROOT / ".ci" / "run").read_text()).group(1)
    except (OSError, AttributeError):
        return None


def check_env(c: Ctx) -> dict:
    """Versions and the device: torch (and whether it is CI's pin), CUDA, NCCL, the GPU."""
    pin = torch_pin()
    out = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_pin": pin}
    out["torch_matches_pin"] = pin is not None and torch.__version__.split("+")[0] == pin
    out.update(interpreter=sys.executable, backend=dist.get_backend(), world=dist.get_world_size())
    out.update(cuda=torch.version.cuda, dry_run=not c.cuda)
    if c.cuda:
        props = torch.cuda.get_device_properties(c.device)
        out.update(device=props.name, capability=f"{props.major}.{props.minor}")
        out.update(memory_gib=round(props.total_memory / 2**30, 1))
        out["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    else:
        out["device"] = "CPU (dry run: Gloo, tiny sizes)"
    out["ok"] = True
    return out


# ---- wait probe --------------------------------------------------------------------------------
def _sync(c: Ctx) -> None:
    if c.cuda:
        torch.cuda.synchronize()


def _host_wait_after_sleep(c: Ctx, timed: bool, ms: float) -> float:
    """Host milliseconds inside ``work.wait`` of an all-reduce queued behind an ``ms`` kernel."""
    t = torch.zeros(256, device=c.device)
    _sync(c)
    torch.cuda._sleep(int(ms * cycles_per_ms()))
    work = dist.all_reduce(t, async_op=True)
    t0 = time.perf_counter()
    work.wait(datetime.timedelta(seconds=60)) if timed else work.wait()
    host = time.perf_counter() - t0
    _sync(c)
    return host * 1e3


def _per_wait_us(c: Ctx, timed: bool, n: int) -> float:
    """Host microseconds per tiny all-reduce + wait, ``n`` of them back to back."""
    t = torch.zeros(64, device=c.device)
    _sync(c)
    t0 = time.perf_counter()
    for _ in range(n):
        work = dist.all_reduce(t, async_op=True)
        work.wait(datetime.timedelta(seconds=60)) if timed else work.wait()
    _sync(c)
    return (time.perf_counter() - t0) / n * 1e6


def check_wait_probe(c: Ctx) -> dict:
    """On this backend's world-1 group: does ``wait(timeout)`` block the host until the
    collective completes (NCCL: yes, it polls) while ``wait()`` does not, and does flatshard
    pass a timeout here (``collectives._bounded_wait``)?"""
    t = torch.zeros(64, device=c.device)
    work = dist.all_reduce(t, async_op=True)  # the communicator starts here (lazily)
    work.wait()
    bounded = getattr(fs_coll, "_bounded_wait", None)
    out = {"flatshard_passes_timeout": bounded(work) if bounded else "unknown"}
    if c.cuda:
        out["timed_host_ms_behind_100ms"] = _host_wait_after_sleep(c, True, 100.0)
        out["untimed_host_ms_behind_100ms"] = _host_wait_after_sleep(c, False, 100.0)
        out["timed_wait_blocks_host"] = out["timed_host_ms_behind_100ms"] > 50
    else:
        out["sleep_probe"] = "skipped: CUDA only (a 100 ms torch.cuda._sleep before the wait)"
    n = 200 if c.cuda else 20
    out["timed_us_per_wait"] = _per_wait_us(c, True, n)
    out["untimed_us_per_wait"] = _per_wait_us(c, False, n)
    out["waits"] = n
    # A failure: flatshard passes a timeout where a timed wait blocks the host.
    out["ok"] = not (out["flatshard_passes_timeout"] is True and out.get("timed_wait_blocks_host"))
    return out


# ---- sync audit --------------------------------------------------------------------------------
def site_of(frames: list[traceback.FrameSummary]) -> str:
    """Where a synchronisation came from: the innermost flatshard frame, else the innermost
    frame outside torch and the warnings machinery."""
    for f in reversed(frames):
        if f.filename.startswith(FLATSHARD_DIR):
            return f"flatshard/{f.filename[len(FLATSHARD_DIR) :]}:{f.lineno} ({f.name})"
    for f in reversed(frames):
        path = f.filename.replace(os.sep, "/")
        if "/torch/" not in path and not path.endswith("warnings.py"):
            return f"{Path(path).name}:{f.lineno} ({f.name})"
    return "<torch>"


@contextlib.contextmanager
def sync_warnings(cuda: bool):
    """``torch.cuda.set_sync_debug_mode("warn")`` inside (CUDA); yields a Counter of sites
    (``site_of``) of the synchronisation warnings, which are not shown."""
    sites: Counter = Counter()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        previous = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if SYNC_TEXT in str(message):
                sites[site_of(traceback.extract_stack()[:-1])] += 1
            else:
                previous(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")


def _audited_step(c: Ctx, offload: bool) -> Counter:
    """Two warm-up steps, then one steady step (forward, backward, AdamW, zero_grad; no
    ``.item()``) of the forced bf16 model under ``sync_warnings``."""
    with forced_groups():
        model = c.sharded(
            mixed_precision=fs.MixedPrecision(**MP), offload=fs.CPUOffload() if offload else None
        )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(x):
        lm_loss(model, x).backward()
        opt.step(), opt.zero_grad()

    step(c.x), step(c.x2)
    _sync(c)
    with sync_warnings(c.cuda) as sites:
        step(c.x)
    _sync(c)
    return sites


def check_sync_audit(c: Ctx) -> dict:
    """Device synchronisations per steady step, forced bf16 with and without CPU offload."""
    out: dict = {}
    for name, offload in (("bf16", False), ("bf16_offload", True)):
        sites = _audited_step(c, offload)
        ours = sum(n for s, n in sites.items() if s.startswith("flatshard/"))
        out[name] = {"syncs": sum(sites.values()), "flatshard_syncs": ours}
        out[name]["sites"] = dict(sites.most_common(12))
    if not c.cuda:  # the steps and the capture ran; nothing can be seen without CUDA
        out["skipped"] = "CUDA only: torch.cuda.set_sync_debug_mode watches CUDA syncs"
    out["ok"] = True  # a measurement: the counts are the result
    return out
