"""Print the measured parity errors of every test model: world 2 and 3, hybrid 2x2 at world 4.

Run: OMP_NUM_THREADS=1 .venv/bin/python bench/parity_report.py
Same harness as tests/test_engine_parity.py (AdamW, 5 steps, fp32), printed as a table.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from dist_pool import DistPool
from parity_models import CASES, train_parity

FLAT = ("full_shard", "shard_grad_op", "no_shard")


def main() -> None:
    head = ("case", "world", "strategy", "grad", "params", "loss", "noisy")
    print("{:24} {:>5} {:>14} {:>9} {:>9} {:>9} {:>7}".format(*head))
    plan = {2: FLAT, 3: FLAT, 4: ("hybrid_shard",)}  # hybrid: a 2x2 (replicate, shard) mesh
    for world, strategies in plan.items():
        pool = DistPool(world)
        try:
            for strategy in strategies:
                for name in sorted(CASES):
                    r = pool.run(train_parity, name, 5, 2, strategy)[0]
                    print(
                        f"{name:24} {world:>5} {strategy:>14} {r['grad_err']:9.1e} "
                        f"{r['sd_err']:9.1e} {r['loss_err']:9.1e} {r['noisy_fraction']:7.2%}"
                    )
        finally:
            pool.close()


if __name__ == "__main__":
    main()
