"""Train a small GPT with ``lightning.Trainer`` and ``strategy="flatshard"`` on 2 CPU processes.

    pip install -e ".[lightning]"
    OMP_NUM_THREADS=1 python examples/lightning_train.py      # Lightning starts rank 1 itself

The LightningModule is ordinary Lightning code; only ``strategy=`` changes.
"""

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import flatshard.integrations.lightning  # noqa: F401  (registers strategy="flatshard")
from flatshard.models import GPT, GPTConfig


class LitGPT(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = GPT(GPTConfig(vocab_size=64, d_model=64, n_layers=4, n_heads=4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)  # built after sharding


def main() -> None:
    data = torch.randint(0, 64, (256, 33))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=8)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="flatshard", max_steps=30,
        gradient_clip_val=1.0, accumulate_grad_batches=2, precision="bf16-mixed",
        logger=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(LitGPT(), loader)
    trainer.save_checkpoint("lightning-flatshard.ckpt")  # a directory: fs.save's shards


if __name__ == "__main__":
    main()
