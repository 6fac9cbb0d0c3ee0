"""lightning.Fabric with ``FlatshardStrategy(tensor_parallel_size=2, parallelize_fn=...)``
(the Fabric flavour, ``flatshard.integrations.lightning.fabric``).

As tests/test_integration_lightning_tp.py does for the Trainer: this file run as a script is
rank 0 and Fabric's launcher starts the other ranks by running it again. World 4 trains with
``tensor_parallel_size=2`` (2 dp x 2 tp; ``parallelize_fn`` applies a Colwise/Rowwise plan to
each block's MLP), world 2 the same model with ``tensor_parallel_size=1`` on the same global
batches (``fabric.setup_dataloaders`` splits over dp only); clipping by the global norm over
both axes. A tp run's rank ``r`` is dp rank ``r // 2`` and must match the world-2 run's rank
``r // 2`` step by step.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

TOL = 1e-5  # fp32: the house bar for parity
VOCAB, DIM, FFN, SEQ, STEPS = 32, 16, 32, 8, 6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up, self.down = nn.Linear(DIM, FFN), nn.Linear(FFN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def parallelize_mlps(module: nn.Module, mesh) -> nn.Module:
    """The user's plan: each block's MLP colwise then rowwise on the tp axis."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    for block in module.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    module.dtensor_params = sum(type(p).__name__ == "DTensor" for p in module.parameters())
    return module


def fit(out: Path, devices: int, tp: int) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    import flatshard as fs
    from flatshard.integrations.lightning.fabric import FlatshardStrategy

    strategy = FlatshardStrategy(
        policy=fs.wrap.by_type(Block),
        timeout=timedelta(seconds=120),
        tensor_parallel_size=tp,
        parallelize_fn=parallelize_mlps if tp > 1 else None,
    )
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    fabric.launch()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (64, SEQ), generator=g)
    loader = DataLoader(TensorDataset(x, (3 * x + 1) % VOCAB), batch_size=4)  # learnable
    loader = fabric.setup_dataloaders(loader, move_to_device=False)
    model = fabric.setup_module(Model())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses, norms = [], []
    for _step, (xb, yb) in zip(range(STEPS), loader, strict=False):
        loss = F.cross_entropy(model(xb).reshape(-1, VOCAB), yb.reshape(-1))
        fabric.backward(loss)
        norms.append(float(fabric.clip_gradients(model, opt, max_norm=0.5)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    dtensors = getattr(model, "dtensor_params", 0)  # counted by the plan (Fabric forwards)
    return {"losses": losses, "norms": norms, "dtensor_params": dtensors}


def _launch(out: Path, devices: int, tp: int) -> list[dict]:
    import subprocess

    keep = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")
    env = {k: v for k, v in os.environ.items() if k not in keep}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, __file__, str(out), str(devices), str(tp)]
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(devices)]


if __name__ == "__main__":  # one rank of a launch: python this_file.py OUT DEVICES TP
    where, n, tp_size = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    result = fit(where, n, tp_size)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    (where / f"rank{rank}.json").write_text(json.dumps(result))
    sys.exit(0)

import pytest  # noqa: E402  (the pytest side: the script above runs without it)

pytest.importorskip("lightning", reason="the [lightning] extra is not installed")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("fabric_tp")
    (root / "tp2").mkdir(), (root / "tp1").mkdir()
    return {"tp2": _launch(root / "tp2", 4, 2), "tp1": _launch(root / "tp1", 2, 1)}


@pytest.mark.slow  # two launches of 4 and 2 Lightning processes: ~1-2.5 min on 2 cores
def test_fabric_tp2_equals_tp1_on_the_same_global_batches(runs):
    for rank, res in enumerate(runs["tp2"]):
        ref = runs["tp1"][rank // 2]
        assert len(res["losses"]) == STEPS and res["losses"][-1] < res["losses"][0] - 0.1
        for key in ("losses", "norms"):  # the loss and the clipped norm over both axes
            pairs = zip(res[key], ref[key], strict=True)
            worst = max(abs(a - b) / abs(b) for a, b in pairs)
            assert worst <= TOL, (rank, key, res[key], ref[key])
        assert res["dtensor_params"] == 8 and ref["dtensor_params"] == 0  # the plan ran
    assert runs["tp1"][0]["losses"] != runs["tp1"][1]["losses"]  # each dp rank its own data
