"""``bench/gpu_check.sh --dry-run`` runs every section on the CPU and reports each (the GPU
check must not rot between the rare runs on a GPU), and the parts that read what only a GPU
produces (profiler traces, sync warnings) are right on synthetic input.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ["env", "wait_probe", "forced", "checks_forced", "sync_audit", "ab", "profiler"]
SECTIONS += [
    "checks_plain",
    "torch_cp",
    "sanitizer",
]  # the last: TORCH_CUDA_SANITIZER=1, its own process
# What a CPU run cannot do, each skipped with its reason (all other checks must pass).
CUDA_ONLY = {("forced", "delay_side_stream"), ("sync_audit", "sync_audit")}
CUDA_ONLY |= {("profiler", "profiler"), ("sanitizer", "sanitizer_on"), ("torch_cp", "torch_cp")}


@pytest.fixture(scope="module")
def bench_path():
    sys.path.insert(0, str(ROOT / "bench"))
    yield
    sys.path.remove(str(ROOT / "bench"))


def test_dry_run_reports_every_section(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GPU_CHECK_TIMEOUT_S": "200"}
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=230,
    )  # fmt: skip
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] and report["ok"]
    assert list(report["sections"]) == SECTIONS
    for name, section in report["sections"].items():
        assert "budget" not in section.get("skipped", ""), f"{name} did not run: {section}"
        for check, r in section["checks"].items():
            if (name, check) in CUDA_ONLY:
                assert r["status"] == "skip" and "CUDA" in r["skipped"], (name, check, r)
            else:
                assert r["status"] == "pass", (name, check, r)
    forced = report["sections"]["checks_forced"]["checks"]
    assert all(r["issued"] for r in forced.values()), "a forced check issued no collective"
    calls = report["sections"]["ab"]["checks"]["bf16"]["modes"]["flatshard_forced"]
    assert calls["collectives_per_step"].get("all_gather:cpu", 0) > 0
    sanitized = report["sections"]["sanitizer"]["checks"]
    assert {"hybrid_shard", "cpu_offload"} <= set(sanitized), sanitized
    assert all(sanitized[c]["issued"] > 0 for c in ("hybrid_shard", "cpu_offload")), sanitized
    log = (tmp_path / "gpu_check.log").read_text()
    assert "== sanitizer (TORCH_CUDA_SANITIZER=unset" in log, log[-2000:]  # CUDA only
    assert "PASS  hybrid_shard" in (tmp_path / "gpu_check.txt").read_text()
    summary = (tmp_path / "gpu_check.md").read_text()
    assert "PASSED" in summary and all(f"| {name} |" in summary for name in SECTIONS)
    assert (tmp_path / "gpu_check.txt").exists() and (tmp_path / "gpu_check.log").exists()


def _kernel(ts, dur, stream, name="gemm"):
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "ts": ts,
        "dur": dur,
        "args": {"stream": stream},
    }


def test_gpu_activity_from_a_trace(bench_path):
    from gpu_check_profile import STEP, gpu_activity

    step = {"ph": "X", "cat": "user_annotation", "name": STEP, "dur": 100}
    events = [{**step, "ts": 0}, {**step, "ts": 200}]  # two steps of 100 us, a gap between
    events += [_kernel(10, 30, 7), _kernel(30, 20, 7), _kernel(220, 50, 7)]  # 40 + 50 busy
    events += [_kernel(150, 40, 7)]  # between the steps: not counted
    events += [_kernel(60, 30, 20, "ncclDevKernel_AllGather"), _kernel(95, 10, 21, "copy")]
    out = gpu_activity(events)
    assert out["steps"] == 2 and out["step_ms"] == pytest.approx(0.1)
    assert out["compute_stream"] == 7  # the most non-NCCL kernel time
    assert out["compute_stream_idle_share"] == pytest.approx(1 - 90 / 200)
    assert out["all_streams_idle_share"] == pytest.approx(1 - (40 + 30 + 5 + 50) / 200)
    assert out["nccl_kernels"] == 1 and out["nccl_ms"] == pytest.approx(0.03)
    assert "skipped" in gpu_activity([{**step, "ts": 0}])  # a CPU trace: no kernels


def test_sync_warnings_are_counted_by_flatshard_line(bench_path):
    import gpu_check_probe as probe

    inner = traceback.FrameSummary(probe.FLATSHARD_DIR + "core/state.py", 261, "finish")
    outer = traceback.FrameSummary(str(ROOT / "bench" / "x.py"), 5, "step")
    torch_frame = traceback.FrameSummary("/site-packages/torch/_tensor.py", 9, "item")
    assert probe.site_of([outer, inner, torch_frame]) == "flatshard/core/state.py:261 (finish)"
    assert probe.site_of([outer, torch_frame]) == "x.py:5 (step)"

    def sync_here():
        warnings.warn("called a " + probe.SYNC_TEXT, UserWarning, stacklevel=1)

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with probe.sync_warnings(cuda=False) as sites:
            sync_here(), sync_here()
            warnings.warn("something else", UserWarning, stacklevel=1)
    assert sum(sites.values()) == 2 and len(sites) == 1
    assert next(iter(sites)).startswith("test_gpu_check.py:")
    assert [str(w.message) for w in shown] == ["something else"]  # others still shown
