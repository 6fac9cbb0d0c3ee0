"""The profiler part of ``bench/gpu_check.py``: a few steady steps of the A/B model under
``torch.profiler`` (flatshard with real collectives, and FSDP2), read back from the Chrome
trace: how much of each step the compute stream sits idle (the GPU waiting for the host or
for communication), NCCL kernel time, and the host time flatshard spends inside
``PendingWork.wait`` (timed directly, the outermost wait of each chain).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import threading
import time

import torch
from gpu_check_bench import new_run, timed_step
from gpu_check_common import tokens
from torch.profiler import ProfilerActivity, profile, record_function

import flatshard.comm.collectives as fs_coll
from flatshard.models import GPTConfig

STEP = "gpu_check_step"  # the record_function around each profiled step
PROFILED = ("flatshard_forced", "fsdp2")


class WaitClock:
    """Host seconds inside ``PendingWork.wait`` (outermost calls; per thread)."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0
        self._local = threading.local()
        self._original = fs_coll.PendingWork.wait

    def __enter__(self) -> WaitClock:
        original, clock = self._original, self

        def wait(work, timeout):
            if getattr(clock._local, "depth", 0):
                return original(work, timeout)
            clock._local.depth = 1
            t0 = time.perf_counter()
            try:
                return original(work, timeout)
            finally:
                clock.seconds += time.perf_counter() - t0
                clock.calls += 1
                clock._local.depth = 0

        fs_coll.PendingWork.wait = wait
        return self

    def __exit__(self, *exc) -> None:
        fs_coll.PendingWork.wait = self._original


def _union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals``."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _clip(intervals, windows) -> list[tuple[float, float]]:
    return [
        (max(a, lo), min(b, hi)) for a, b in intervals for lo, hi in windows if a < hi and b > lo
    ]


def gpu_activity(events: list[dict]) -> dict:
    """From Chrome-trace events: the profiled steps' host windows (``STEP``), and inside them
    the share of time the compute stream (the stream with the most non-NCCL kernel time)
    runs nothing, the share no stream runs anything, and NCCL kernel time."""
    steps = [e for e in events if e.get("name") == STEP and e.get("cat") == "user_annotation"]
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in steps]
    span = sum(b - a for a, b in windows)
    out: dict = {"steps": len(windows), "step_ms": span / 1e3 / max(len(windows), 1)}
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu or not span:
        out["skipped"] = "no CUDA kernels in the trace (the CPU dry run)"
        return out

    def stream(e: dict):
        return e.get("args", {}).get("stream")

    def is_nccl(e: dict) -> bool:
        return e["cat"] == "kernel" and e.get("name", "").lower().startswith("nccl")

    by_stream: dict = {}
    for e in gpu:
        if e["cat"] == "kernel" and not is_nccl(e):
            by_stream[stream(e)] = by_stream.get(stream(e), 0) + e["dur"]
    compute = max(by_stream, key=by_stream.get) if by_stream else None
    mine = [(e["ts"], e["ts"] + e["dur"]) for e in gpu if stream(e) == compute]
    every = [(e["ts"], e["ts"] + e["dur"]) for e in gpu]
    nccl = [e for e in gpu if is_nccl(e)]
    out.update(compute_stream=compute, streams=len({stream(e) for e in gpu}))
    out["compute_stream_idle_share"] = 1 - _union(_clip(mine, windows)) / span
    out["all_streams_idle_share"] = 1 - _union(_clip(every, windows)) / span
    out.update(nccl_kernels=len(nccl), nccl_ms=sum(e["dur"] for e in nccl) / 1e3)
    return out


def _profile_run(run: dict, x: torch.Tensor, cuda: bool, steps: int) -> dict:
    """``steps`` steps of ``run`` under the profiler and the wait clock."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with WaitClock() as clock, profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function(STEP):
                timed_step(run, x, cuda)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    out = gpu_activity(events)
    out["host_wait_ms_per_step"] = clock.seconds * 1e3 / steps
    out["waits_per_step"] = clock.calls / steps
    out["host_wait_share"] = clock.seconds / max(sum(run["times"][-steps:]), 1e-9)
    return out


def check_profiler(c, args: argparse.Namespace) -> dict:
    """2 warm-up steps, then ``args.profile_steps`` profiled ones, per mode of ``PROFILED``
    (the A/B's model, batch and precision: its first row)."""
    precision = args.bench_precisions.split(",")[0]
    cfg = GPTConfig.preset(args.bench_model, max_seq_len=args.bench_seq)
    x = tokens(cfg.vocab_size, args.bench_batch, args.bench_seq, 3, c.device)
    out: dict = {"model": args.bench_model, "precision": precision, "steps": args.profile_steps}
    for mode in PROFILED:
        run = new_run(mode, cfg, c.device, precision)
        for _ in range(2):
            timed_step(run, x, c.cuda)
        out[mode] = _profile_run(run, x, c.cuda, args.profile_steps)
        del run
        gc.collect()
        if c.cuda:
            torch.cuda.empty_cache()
    if not c.cuda:  # the host side (wait clock, trace parsing) ran; GPU idle needs CUDA
        out["skipped"] = "CUDA only: GPU idle share (the dry run timed the host waits)"
    out["ok"] = True  # a measurement
    return out
