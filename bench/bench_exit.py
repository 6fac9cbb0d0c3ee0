"""How often a Gloo worker aborts at exit, with and without ``end_process_group``.

The workload is plain torch (no flatshard in it but the helper): a small model and its AdamW
(whose first use imports ``torch._dynamo``: without it the abort did not show, 0 in 30), a
few ``barrier``/``all_reduce`` rounds as a training loop's timing would do, then the end of
the process group and a normal return. Each run is a fresh ``torchrun`` of 2 ranks; a run counts
as aborted when a rank printed "terminate called without an active exception". See
[Note: the exit abort] in ``flatshard/comm/shutdown.py``.

    python bench/bench_exit.py --runs 30
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = """
import os, sys, time, torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(50)])
optimizer = torch.optim.AdamW(model.parameters())
for _ in range(8):
    dist.barrier()
    t0 = time.perf_counter()
    took = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
if sys.argv[1] == "helper":
    from flatshard.comm.shutdown import end_process_group
    end_process_group()
else:
    dist.destroy_process_group()
"""

ABORT = "terminate called without an active exception"


def one_run(script: Path, variant: str) -> bool:
    """True if a rank aborted at exit."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*cmd, str(script), variant], env=env, capture_output=True, text=True)
    return ABORT in done.stdout + done.stderr


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=30, help="launches per variant")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(WORKER)
        for variant in ("plain", "helper"):
            aborts = sum(one_run(script, variant) for _ in range(args.runs))
            what = "destroy_process_group" if variant == "plain" else "end_process_group"
            print(f"{what:22s} {aborts}/{args.runs} runs aborted at exit")


if __name__ == "__main__":
    main()
