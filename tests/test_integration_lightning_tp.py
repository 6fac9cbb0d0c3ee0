"""Lightning's Trainer with ``FlatshardStrategy(tensor_parallel_size=2, parallelize_fn=...)``.

Two launches for the module, as a user's ``train.py``: this file run as a script is rank 0 and
Lightning's own launcher starts the other ranks by running it again. World 4 trains with
``tensor_parallel_size=2`` (2 dp x 2 tp; ``parallelize_fn`` applies a Colwise/Rowwise plan to
each block's MLP); world 2 trains the same module with ``tensor_parallel_size=1`` (no plan) on
the same global batches. Each rank writes its per-step losses; a tp run's rank ``r`` is dp rank
``r // 2`` and must match the world-2 run's rank ``r // 2`` step by step.
"""

from __future__ import annotations

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


def lit_module():
    import lightning as L

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = nn.Embedding(VOCAB, DIM)
            self.blocks = nn.ModuleList(Block() for _ in range(2))
            self.head = nn.Linear(DIM, VOCAB)
            self.losses: list[float] = []
            self.first_batch = 0

        def training_step(self, batch, batch_idx):
            x, y = batch
            if batch_idx == 0:
                self.first_batch = int(x.sum())
            h = self.embed(x)
            for block in self.blocks:
                h = block(h)
            logits = self.head(h)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    return Lit()


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
    from flatshard.integrations.lightning import FlatshardStrategy

    strategy = FlatshardStrategy(
        policy=fs.wrap.by_type(Block),
        timeout=timedelta(seconds=120),
        tensor_parallel_size=tp,
        parallelize_fn=parallelize_mlps if tp > 1 else None,
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (64, SEQ), generator=g)
    loader = DataLoader(TensorDataset(x, (3 * x + 1) % VOCAB), batch_size=4)  # learnable
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=str(out),
    )  # fmt: skip
    module = lit_module()
    trainer.fit(module, loader)
    mesh = module.device_mesh
    return {
        "losses": module.losses,
        "first_batch": module.first_batch,
        "mesh": [list(mesh.mesh_dim_names), list(mesh.shape)],
        "sampler": trainer.strategy.distributed_sampler_kwargs,
        "dtensor_params": getattr(module, "dtensor_params", 0),  # counted by the plan
    }


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
    root = tmp_path_factory.mktemp("lightning_tp")
    (root / "tp2").mkdir(), (root / "tp1").mkdir()
    return {
        "tp2": run_lightning_ranks(__file__, root / "tp2", 4, 2),
        "tp1": run_lightning_ranks(__file__, root / "tp1", 2, 1),
    }


# The module's two Lightning launches (world 4 and 2) cost ~30 s: .ci/run's slow pass.
@pytest.mark.slow
def test_tp2_trains_and_equals_tp1_on_the_same_global_batches(runs):
    for rank, res in enumerate(runs["tp2"]):
        losses, ref = res["losses"], runs["tp1"][rank // 2]["losses"]
        assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
        assert losses[-1] < losses[0] - 0.1, losses  # it learns
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref, strict=True))
        assert worst <= TOL, (rank, losses, ref)
    assert runs["tp1"][0]["losses"] != runs["tp1"][1]["losses"]  # each dp rank its own data


@pytest.mark.slow
def test_mesh_sampler_and_plan(runs):
    for rank, res in enumerate(runs["tp2"]):
        assert res["mesh"] == [["dp", "tp"], [2, 2]]  # LightningModule.device_mesh
        assert res["sampler"] == {"num_replicas": 2, "rank": rank // 2}
        assert res["first_batch"] == runs["tp1"][rank // 2]["first_batch"]  # tp peers: same data
        assert res["dtensor_params"] == 8  # up and down, weight and bias, of 2 blocks
    assert runs["tp1"][1]["mesh"] == [["dp", "tp"], [2, 1]]
    assert runs["tp1"][1]["dtensor_params"] == 0


def test_bad_tensor_parallel_arguments_are_refused():
    from flatshard.integrations.lightning import FlatshardStrategy

    with pytest.raises(ValueError, match=r"tensor_parallel_size=0\) must be >= 1"):
        FlatshardStrategy(tensor_parallel_size=0)
    with pytest.raises(TypeError, match=r"parallelize_fn='plan'\) must be a function"):
        FlatshardStrategy(tensor_parallel_size=2, parallelize_fn="plan")
