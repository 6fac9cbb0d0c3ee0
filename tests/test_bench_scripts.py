"""Every script in bench/ runs, at tiny sizes: a benchmark must not silently rot when the code
under it moves. Only that it completes is checked (timings are never asserted); the scripts
that already have their own tests (fault_*.py, soak.py in the slow suite, gpu_check.sh in
test_gpu_check.py) are not repeated.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
TINY = ["--dim", "32", "--layers", "1", "--heads", "2", "--vocab", "64"]
TORCHRUN4 = [*TORCHRUN[:-1], "4"]  # world 4: dp 2 x tp 2, pp 2 x dp 2

SCRIPTS = {
    "bench_step.py": (TORCHRUN, [*TINY, "--steps", "3", "--batch", "1", "--seq", "16"]),
    "bench_checkpoint.py": (
        TORCHRUN,
        [*TINY, "--rounds", "1", "--seq", "8", "--writer-mb", "1", "--dir", "{tmp}"],
    ),
    "bench_compile.py": (
        TORCHRUN,
        [*TINY, "--steps", "3", "--batch", "1", "--seq", "16", "--backend", "aot_eager"],
    ),
    "bench_precision.py": (
        TORCHRUN,
        ["--preset", "tiny", "--rows", "1", "--seq", "32", "--steps", "4"],
    ),
    "bench_packing.py": ([sys.executable], ["--quick", "--steps", "1"]),
    "bench_checkpointing.py": ([sys.executable], ["--layers", "2", "--dim", "24"]),
    "bench_pretrained_load.py": ([sys.executable], [*TINY, "--worlds", "1", "--dir", "{tmp}/w"]),
    "parity_report.py": ([sys.executable], ["--cases", "gpt_tied", "--worlds", "2"]),
    "bench_muon.py": (TORCHRUN, [*TINY, "--rounds", "1", "--seq", "8"]),
    "bench_pp.py": (
        TORCHRUN4,
        [
            *TINY,
            "--layers",
            "2",
            "--rounds",
            "3",
            "--seq",
            "8",
            "--microbatches",
            "2",
            "--keep-gathered",
        ],
    ),
    "bench_tp.py": (
        TORCHRUN4,
        [*TINY, "--rounds", "3", "--seq", "8", "--batch", "1", "--precisions", "fp32"],
    ),
    "bench_integrations.py": (
        TORCHRUN,
        [
            "--rounds",
            "1",
            "--steps",
            "3",
            "--dim",
            "16",
            "--layers",
            "1",
            "--seq",
            "8",
            "--out",
            "{tmp}",
        ],
    ),
    "bench_exit.py": ([sys.executable], ["--runs", "1"]),
    "bench_host_overhead.py": ([sys.executable], ["--units", "2", "--rounds", "4", "--dim", "8"]),
    "bench_low_precision.py": (
        [sys.executable],
        [
            "--worlds",
            "2",
            "--steps",
            "2",
            "--settings",
            "int8+ef",
            "--runs-dir",
            "{tmp}",
            "--plot",
            "{tmp}/p.png",
            "--",
            "--model.d_model",
            "32",
            "--model.n_layers",
            "1",
            "--model.n_heads",
            "2",
            "--data.seq_len",
            "32",
        ],
    ),
    "bench_reduce_precision.py": (
        [sys.executable],
        ["--worlds", "2", "--dim", "16", "--layers", "1", "--steps", "2"],
    ),
}


def test_every_bench_script_is_covered():
    scripts = {p.name for p in (ROOT / "bench").iterdir() if p.suffix in (".py", ".sh")}
    own_tests = {"fault_common.py", "fault_kill.py", "fault_restart.py", "fault_save.py", "soak.py"}
    own_tests.add("gpu_check.sh")  # tests/test_gpu_check.py runs its --dry-run
    own_tests |= {"multinode.py", "multinode_script.py"}  # tests/slow/test_multinode.py
    # run by gpu_check.sh (gpu_check.py and the modules it imports)
    helpers = {s for s in scripts if s.startswith("gpu_check") and s.endswith(".py")}
    assert scripts - own_tests - helpers == set(SCRIPTS)


# Run by .ci/run's slow pass: the world-4 launches (about 20-30 s each on 2 cores) and every
# script whose launch costs more than a few seconds (together ~80 s of the README's command);
# bench_step.py, the one the README's benchmark uses, stays in the README's command.
SLOW = set(SCRIPTS) - {"bench_step.py"}


@pytest.mark.parametrize(
    "script",
    [pytest.param(s, marks=pytest.mark.slow) if s in SLOW else s for s in sorted(SCRIPTS)],
)
def test_bench_script_runs_at_tiny_size(script, tmp_path):
    launcher, args = SCRIPTS[script]
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*launcher, str(ROOT / "bench" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
