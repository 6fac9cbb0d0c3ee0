"""Activation memory and collectives of every activation-checkpointing route, side by side.

Run: OMP_NUM_THREADS=1 .venv/bin/python bench/bench_checkpointing.py [--layers 8 --dim 128]

World 2, full_shard, the second step of each route (recorded prefetch order). Memory is live
tensor bytes counted by ``flatshard.tools.estimate.measure.LiveBytes`` (gathered parameter buffers
excluded, reported apart): "activations" is what is alive when forward returns, "peak" the
most alive during the step. Routes come from tests/checkpoint_routes.py (the real torch and
Hugging Face APIs); "none" keeps every activation. Ratios are to fs.checkpoint_activations.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from dist_pool import DistPool
from test_user_checkpointing import HF_CASES, TORCH_ROUTES, case_routes, case_step_costs

HF_ROUTES = ["none", "fs_checkpoint_activations", "hf_nonreentrant", "hf_reentrant"]


def _print(title: str, results: dict) -> None:
    ours = results["fs_checkpoint_activations"]
    print(f"\n{title}")
    head = ("route", "activations", "ratio", "peak", "ratio", "gathered", "all_gather", "mlp")
    print("{:32} {:>12} {:>6} {:>10} {:>6} {:>9} {:>10} {:>4}".format(*head))
    for route, r in results.items():
        print(
            f"{route:32} {r['activations']:>12,} {r['activations'] / ours['activations']:6.2f} "
            f"{r['peak']:>10,} {r['peak'] / ours['peak']:6.2f} {r['gathered_peak']:>9,} "
            f"{r['calls'].get('all_gather', 0):>10} {r['mlp_runs']:>4}"
        )


def _parity(world: int) -> None:
    """The parity errors of every route (test_user_checkpointing's harness), worst over ranks."""
    pool = DistPool(world)
    try:
        jobs = [
            (["gpt_tied", "gpt_nested_units"], TORCH_ROUTES, {}),
            (HF_CASES, HF_ROUTES[2:], {"sgd": True}),
        ]
        print(f"\nworld {world}, full_shard, 3 steps: worst relative error")
        print("{:40} {:>9} {:>9} {:>9}".format("model/route", "grad", "params", "loss"))
        for names, routes, kwargs in jobs:
            per_rank = pool.run(case_routes, names, routes, "full_shard", kwargs)
            for key in per_rank[0]:
                grad = max(r[key]["grad_err"] for r in per_rank)
                r0 = per_rank[0][key]
                print(f"{key:40} {grad:9.1e} {r0['sd_err']:9.1e} {r0['loss_err']:9.1e}")
    finally:
        pool.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--parity", action="store_true", help="also print each route's errors")
    args = p.parse_args()
    if args.parity:
        _parity(2)
        _parity(3)
    pool = DistPool(2)
    try:
        routes = ["none", *TORCH_ROUTES]
        tiny = pool.run(case_step_costs, routes, "tiny", (args.layers, args.dim))[0]
        _print(f"TinyGPT, {args.layers} blocks, d={args.dim} (bytes)", tiny)
        hf = pool.run(case_step_costs, HF_ROUTES, "hf_llama", (0, 0))[0]
        _print("HF Llama (tests/parity_models.py, 2 layers) (bytes)", hf)
    finally:
        pool.close()


if __name__ == "__main__":
    main()
