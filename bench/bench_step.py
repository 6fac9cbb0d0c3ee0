"""Step time of flatshard vs torch FSDP2 vs DDP vs an unsharded local step, interleaved.

A thin wrapper over :mod:`flatshard.tools.bench` for running under torchrun yourself (``flatshard
bench`` launches torchrun for you and adds ``--memory``):

    OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=65536 torchrun --nproc-per-node 2 \\
        bench/bench_step.py [--steps 12] [--dim 384 --layers 6 --vocab 8192 --heads 6] \\
        [--model PRESET] [--batch 4 --seq 256] [--precision fp32|bf16] [--json OUT.json] \\
        [--mode all|flatshard|fsdp2|ddp|local]

``--mode X`` runs only X, for its peak RSS. See docs/performance.md for the method and results.
"""

import sys

from flatshard.tools.bench import main

if __name__ == "__main__":
    raise SystemExit(main(["--worker", *sys.argv[1:]]))
