"""examples/moe.py under torchrun: world 4 = ("efsdp", "ep") = (2, 2) (Gloo), a tiny MoEGPT.

The example must exit 0, print one finite loss per step, and the loss must fall. The losses must
also be those of one process holding every expert and training on the global batch (the mean
of the per-rank chunks' losses, the global gradient norm clipped): that holds only if the
experts' gradients are reduced over the right ranks and scaled by the whole world. Printed with
4 decimals, so compared to 2e-4. One torchrun launch (4 ranks: most of its time is start-up).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "moe.py"
WORLD = 4
TINY = {"dim": 16, "layers": 1, "seq": 8, "batch": 2, "steps": 4, "experts": 4, "top-k": 2}


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("moe_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference_losses() -> list[float]:
    """One process, every expert, no sharding: the mean of the ranks' chunk losses."""
    example = _example()
    args = argparse.Namespace(**{k.replace("-", "_"): v for k, v in TINY.items()}, ep=2)
    torch.manual_seed(0)
    model = example.MoEGPT(example.make_config(args))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(args.steps):
        chunks = [example.batch(step, args, WORLD, rank, "cpu") for rank in range(WORLD)]
        loss = torch.stack([model(ids, labels=labels) for ids, labels in chunks]).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _run() -> list[float]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    args = [f"--{k}={v}" for k, v in TINY.items()]
    done = subprocess.run(
        [*torchrun, "--nproc-per-node", str(WORLD), str(EXAMPLE), *args],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return [float(line.split()[-1]) for line in done.stdout.splitlines() if " loss " in line]


@pytest.mark.slow  # a world-4 torchrun launch; tests/test_expert_parallel.py covers EP exactness
def test_example_trains_like_one_process():
    losses = _run()
    assert len(losses) == TINY["steps"], losses
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses
    want = _reference_losses()
    assert max(abs(a - b) for a, b in zip(losses, want, strict=True)) <= 2e-4, (losses, want)
