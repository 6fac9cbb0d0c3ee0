"""Train the reference tiny GPT with flatshard from Python: ``flatshard train``, programmatically.

    python examples/train_tiny_gpt.py [--steps N] [--out DIR] [--resume]
    torchrun --nproc-per-node 2 examples/train_tiny_gpt.py [...]     # as torchrun's workers

Started plainly it launches the workers itself (2 CPU ranks with Gloo, or one per GPU) through
torch's elastic launcher; under torchrun or srun the process is one of the workers. The loop it
runs is ``flatshard.tools.train.trainer`` (packing, global-token loss, AdamW + warm-up/cosine,
clipping, checkpoints); see docs/trainer.md. The same run from the shell::

    flatshard train --steps 300 --out runs/tiny
"""

from __future__ import annotations

import argparse

from flatshard.tools.train import DataConfig, LogConfig, OptimConfig, TrainConfig, run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--out", default="runs/tiny", help="output directory")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    args = p.parse_args()
    cfg = TrainConfig(
        steps=args.steps,
        out=args.out,
        data=DataConfig(seq_len=256, rows=4),  # 2 ranks x 4 rows x 256 tokens per step
        optim=OptimConfig(lr=3e-3, warmup_steps=20),
        log=LogConfig(every=10, val_every=50),
    )
    return run(cfg, resume=args.resume)


if __name__ == "__main__":  # required: the workers are spawned and import this module
    raise SystemExit(main())
