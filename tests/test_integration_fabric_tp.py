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

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from test_integration_lightning_tp import DIM, SEQ, STEPS, TOL, VOCAB, Block, parallelize_mlps


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


if __name__ == "__main__":  # one rank of a launch: python this_file.py OUT DEVICES TP
    from integration_runs import write_rank_result

    where = Path(sys.argv[1])
    write_rank_result(where, fit(where, int(sys.argv[2]), int(sys.argv[3])))
    sys.exit(0)

import pytest  # noqa: E402  (the pytest side: the script above runs without it)

pytest.importorskip("lightning", reason="the [lightning] extra is not installed")

from integration_runs import run_lightning_ranks  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("fabric_tp")
    (root / "tp2").mkdir(), (root / "tp1").mkdir()
    return {
        "tp2": run_lightning_ranks(__file__, root / "tp2", 4, 2),
        "tp1": run_lightning_ranks(__file__, root / "tp1", 2, 1),
    }


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
