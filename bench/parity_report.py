"""Print the measured parity errors of every test model: world 2 and 3, hybrid 2x2 at world 4.

Run: OMP_NUM_THREADS=1 .venv/bin/python bench/parity_report.py [--cases a,b] [--worlds 2,3,4]
Same harness as tests/test_engine_parity.py (AdamW, 5 steps, fp32), printed as a table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from dist_pool import DistPool
from parity_models import CASES, train_parity

FLAT = ("full_shard", "shard_grad_op", "no_shard")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(sorted(CASES)), help="comma-separated names")
    p.add_argument("--worlds", default="2,3,4", help="4 runs hybrid_shard on a 2x2 mesh")
    args = p.parse_args()
    head = ("case", "world", "strategy", "grad", "params", "loss", "noisy")
    print("{:24} {:>5} {:>14} {:>9} {:>9} {:>9} {:>7}".format(*head))
    plan = {2: FLAT, 3: FLAT, 4: ("hybrid_shard",)}  # hybrid: a 2x2 (replicate, shard) mesh
    worlds = {int(w) for w in args.worlds.split(",")}
    for world, strategies in plan.items():
        if world not in worlds:
            continue
        pool = DistPool(world)
        try:
            for strategy in strategies:
                for name in args.cases.split(","):
                    r = pool.run(train_parity, name, 5, 2, strategy)[0]
                    print(
                        f"{name:24} {world:>5} {strategy:>14} {r['grad_err']:9.1e} "
                        f"{r['sd_err']:9.1e} {r['loss_err']:9.1e} {r['noisy_fraction']:7.2%}"
                    )
        finally:
            pool.close()


if __name__ == "__main__":
    main()
