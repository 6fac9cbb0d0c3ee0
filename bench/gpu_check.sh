#!/usr/bin/env bash
# flatshard on one GPU at world 1, in under 5 minutes: correctness checks (fp32 parity, bf16
# mixed precision, CPU offload, save/load, activation checkpointing by every torch and Hugging
# Face route, meta init) and the step overhead vs the bare model and torch FSDP2, in fp32 and
# in bf16 mixed precision. Without CUDA it is a dry run on the CPU (Gloo, tiny sizes) that
# executes the same code. See docs/performance.md, "GPU check".
#
#   bench/gpu_check.sh [OUT_DIR] [gpu_check.py options...]
#
# OUT_DIR (default: $OUT, else /tmp/flatshard_gpu_check) receives gpu_check.json,
# gpu_check.txt and gpu_check.log. PYTHON picks the interpreter (default: .venv/bin/python if
# it imports torch, else python3); flatshard is taken from src/ when it is not installed.
# GPU_CHECK_TIMEOUT_S bounds the whole run (default 290 s).
# Exit status: 0 all passed, 1 a check or the benchmark failed, 124 timed out.
set -uo pipefail
cd "$(dirname "$0")/.."

out_dir="${OUT:-/tmp/flatshard_gpu_check}"
if [[ $# -gt 0 && "$1" != -* ]]; then
    out_dir="$1"
    shift
fi
mkdir -p "$out_dir"

py="${PYTHON:-}"
if [[ -z "$py" ]]; then
    for candidate in .venv/bin/python python3; do
        if "$candidate" -c "import torch" >/dev/null 2>&1; then
            py="$candidate"
            break
        fi
    done
fi
if [[ -z "$py" ]]; then
    echo "gpu_check: no Python with torch found (set PYTHON=...)" >&2
    exit 2
fi

export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export FLATSHARD_TIMEOUT_S="${FLATSHARD_TIMEOUT_S:-60}"  # a hang fails in a minute, not ten
limit="${GPU_CHECK_TIMEOUT_S:-290}"

if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: CUDA is not available: DRY RUN on the CPU with Gloo and tiny sizes"
fi

timeout --kill-after=15 "$limit" \
    "$py" -m torch.distributed.run --standalone --nproc-per-node 1 \
    bench/gpu_check.py --out "$out_dir" "$@" 2>&1 | tee "$out_dir/gpu_check.log"
status=${PIPESTATUS[0]}
if [[ $status -eq 124 || $status -eq 137 ]]; then
    echo "gpu_check: TIMED OUT after ${limit}s (see $out_dir/gpu_check.log)" >&2
fi
exit "$status"
