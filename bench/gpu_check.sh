#!/usr/bin/env bash
# flatshard on one GPU in one command, in at most 7 minutes: real NCCL collectives at world 1
# (the size-one group kept), bit-identical results with every collective delayed on its
# stream, device syncs per steady step, GPU idle share and host time in waits from the
# profiler, flatshard vs FSDP2 (step time, peak memory) on a ~1B bf16 GPT, the activation-
# checkpointing routes and CPU offload; then hybrid_shard and CPU offload under
# TORCH_CUDA_SANITIZER=1 (bench/gpu_check_sanitizer.py: the report's section "sanitizer").
# Without CUDA, or with --dry-run, it is a dry run on
# the CPU (Gloo, tiny sizes) of the same code, the CUDA-only parts skipped with the reason.
# See docs/performance.md, "GPU check", and bench/gpu_check.py for the sections.
#
#   bench/gpu_check.sh [--dry-run] [OUT_DIR] [gpu_check.py options...]
#
# OUT_DIR (default: $OUT, else /tmp/flatshard_gpu_check) receives gpu_check.json (everything),
# gpu_check.md (the summary), gpu_check.txt (the report) and gpu_check.log (all output).
# PYTHON picks the interpreter (default: .venv/bin/python if it imports torch, else python3).
# Nothing is installed: where CI's torch pin (.ci/run) is not there (a fresh GPU machine has
# no .venv and no network), the image's torch runs; gpu_check.json records both versions.
# flatshard is taken from src/ when it is not installed.
# GPU_CHECK_TIMEOUT_S bounds the whole command (default 420 s); sections that would not fit
# are skipped with the reason, and the report is written before the limit.
# Exit status: 0 all passed, 1 a section failed, 2 no Python with torch, 124 timed out.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)

out_dir="${OUT:-/tmp/flatshard_gpu_check}"
dry_run=0
args=()
leading=1  # OUT_DIR may only come first (after --dry-run): not an option's value
for arg in "$@"; do
    if [[ "$arg" == --dry-run ]]; then
        dry_run=1
        args+=("$arg")
    elif [[ $leading -eq 1 && "$arg" != -* ]]; then
        out_dir="$arg"
        leading=0
    else
        args+=("$arg")
        leading=0
    fi
done
mkdir -p "$out_dir"

if [[ $dry_run -eq 1 ]]; then
    export CUDA_VISIBLE_DEVICES=""  # torch sees no GPU: the CPU path, Gloo
fi
# One import of torch per candidate: "<1 if CUDA is available, else 0> <interpreter> <torch>"
probe='import sys, torch; print(int(torch.cuda.is_available()), sys.executable, torch.__version__)'
info=""
candidates=(.venv/bin/python python3)
if [[ -n "${PYTHON:-}" ]]; then
    candidates=("$PYTHON")
fi
for candidate in "${candidates[@]}"; do
    if info=$("$candidate" -c "$probe" 2>/dev/null); then
        py="$candidate"
        break
    fi
done
if [[ -z "$info" ]]; then
    echo "gpu_check: no Python with torch found (set PYTHON=...)" >&2
    exit 2
fi
echo "gpu_check: ${info#* } (torch)"
if [[ "${info%% *}" != 1 ]]; then
    echo "gpu_check: CUDA is not available: DRY RUN on the CPU with Gloo and tiny sizes"
fi

export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export FLATSHARD_TIMEOUT_S="${FLATSHARD_TIMEOUT_S:-60}"  # a hang fails in a minute, not ten
limit="${GPU_CHECK_TIMEOUT_S:-420}"  # the whole command, this script's start included
left=$((limit - ($(date +%s) - start)))
# The Python side starts no section it cannot finish and writes its report before the limit,
# leaving GPU_CHECK_SANITIZER_S (default 60 s on a GPU, 20 s on the CPU) to the sanitizer step.
if [[ "${info%% *}" == 1 ]]; then
    reserve="${GPU_CHECK_SANITIZER_S:-60}"
else
    reserve="${GPU_CHECK_SANITIZER_S:-20}"
fi
export GPU_CHECK_DEADLINE=$((start + limit - 25 - reserve))

timeout --kill-after=10 "$left" \
    "$py" -m torch.distributed.run --standalone --nproc-per-node 1 \
    bench/gpu_check.py --out "$out_dir" "${args[@]}" 2>&1 | tee "$out_dir/gpu_check.log"
status=${PIPESTATUS[0]}
if [[ $status -eq 124 || $status -eq 137 ]]; then
    echo "gpu_check: TIMED OUT after ${limit}s (see $out_dir/gpu_check.log)" >&2
    exit "$status"
fi

# Then the hybrid_shard and CPU-offload cases under torch's CUDA sanitizer, in a process of
# their own (the variable acts at `import torch`, and slows every launch): they add the section
# `sanitizer` to the report above (gpu_check.json, .md, .txt) and their output to the log.
# Without CUDA they run on the CPU without the sanitizer (skipped there with the reason).
left=$((limit - ($(date +%s) - start)))
if [[ ! -f "$out_dir/gpu_check.json" ]]; then
    echo "gpu_check: no report to add the sanitizer to (see $out_dir/gpu_check.log)" >&2
    exit "$status"
fi
if [[ $left -lt 30 ]]; then
    echo "gpu_check: sanitizer SKIPPED (${left}s left of ${limit}s)" | tee -a "$out_dir/gpu_check.log"
    exit "$status"
fi
sanitize=(env TORCH_CUDA_SANITIZER=1)
if [[ "${info%% *}" != 1 ]]; then
    # torch without CUDA fails at its first op under the sanitizer (set at all: even empty)
    sanitize=(env -u TORCH_CUDA_SANITIZER)
    echo "gpu_check: no CUDA: the sanitizer cases run without TORCH_CUDA_SANITIZER" \
        | tee -a "$out_dir/gpu_check.log"
fi
"${sanitize[@]}" timeout --kill-after=10 "$left" \
    "$py" -m torch.distributed.run --standalone --nproc-per-node 1 \
    bench/gpu_check_sanitizer.py --out "$out_dir" 2>&1 | tee -a "$out_dir/gpu_check.log"
sanitizer=${PIPESTATUS[0]}
if [[ $sanitizer -eq 124 || $sanitizer -eq 137 ]]; then
    echo "gpu_check: sanitizer TIMED OUT after ${limit}s (see $out_dir/gpu_check.log)" >&2
    exit "$sanitizer"
fi
if [[ $status -eq 0 ]]; then
    status=$sanitizer
fi
exit "$status"
