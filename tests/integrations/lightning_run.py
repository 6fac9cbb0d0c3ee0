"""Every Lightning case in one launch: ``python lightning_run.py OUT_DIR``.

Run as a plain script: Lightning's own launcher (``_SubprocessScriptLauncher``) starts rank 1
by running this file again, exactly as for a user's ``train.py`` on ``devices=2``. Each case
trains the same tiny GPT LightningModule from the same seeds under Lightning's DDP strategy
and under ``strategy="flatshard"``; every rank writes what it measured to
``OUT_DIR/rank<r>.json`` and the test compares.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

import flatshard as fs
from flatshard.comm.shutdown import exit_after_group
from flatshard.integrations.lightning import (
    FabricFlatshardStrategy,
    FlatshardPrecision,
    FlatshardStrategy,
)
from flatshard.models import GPT, GPTConfig
from flatshard.models.block import Block

TIMEOUT = timedelta(seconds=120)
CFG = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)


def tokens(n: int = 96, seq: int = 8, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, CFG.vocab_size, (n, seq + 1), generator=g)
    return TensorDataset(data[:, :-1], data[:, 1:])


class LitGPT(L.LightningModule):
    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(CFG)
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def trainer(strategy, steps: int, out: Path, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(out),
        use_distributed_sampler=True,
        **kwargs,
    )


def loader(n: int = 96) -> DataLoader:
    return DataLoader(tokens(n), batch_size=4, shuffle=False)


def fit(strategy, steps: int, out: Path, ckpt: str | None = None, n: int = 96, **kwargs):
    module = LitGPT()
    t = trainer(strategy, steps, out, **kwargs)
    t.fit(module, loader(n), ckpt_path=ckpt)
    return module.losses, t


def flat(**kwargs) -> FlatshardStrategy:
    return FlatshardStrategy(policy=fs.wrap.by_type(Block), timeout=TIMEOUT, **kwargs)


def case_trainer(out: Path) -> dict:
    """DDP vs flatshard: plain, clipped + accumulated, and bf16/fp16 mixed."""
    res = {}
    res["ddp"], _ = fit("ddp", 10, out)
    res["flat"], _ = fit(flat(), 10, out)
    more = dict(gradient_clip_val=0.05, accumulate_grad_batches=2)
    res["ddp_clip_acc"], _ = fit("ddp", 6, out, **more)
    res["flat_clip_acc"], _ = fit(flat(), 6, out, **more)
    res["ddp_bf16"], _ = fit("ddp", 4, out, precision="bf16-mixed")
    res["flat_bf16"], t = fit("flatshard", 4, out, precision="bf16-mixed")  # by name
    res["mp_bf16"] = str(t.strategy.options.shard_kwargs_with(t.precision_plugin.mixed_precision))
    # Lightning maps precision="16-mixed" to bf16 on CPU: fp16 needs the plugins explicitly
    amp16 = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**8))
    res["ddp_fp16"], _ = fit("ddp", 4, out, plugins=[amp16])
    fp16 = FlatshardPrecision("16-mixed", fs.GradScaler(init_scale=2.0**8))
    res["flat_fp16"], t = fit(flat(), 4, out, plugins=[fp16])
    res["meta"] = trainer_meta_init(out)
    res["scaler_fp16"] = [
        type(t.precision_plugin.scaler).__name__,
        t.precision_plugin.scaler.get_scale(),
    ]
    return res


def trainer_meta_init(out: Path) -> dict:
    """``trainer.init_module(empty_init=True)``: the LightningModule is built on meta and
    ``strategy.setup`` materialises it unit by unit (``reset_parameters``)."""
    t = trainer(flat(), 6, out)
    with t.init_module(empty_init=True):
        module = LitGPT()
    on_meta = all(p.device.type == "meta" for p in module.parameters())
    t.fit(module, loader())
    return {"built_on_meta": on_meta, "losses": module.losses}


def case_resume(out: Path, state_dict_type: str) -> dict:
    """Save after 5 steps, resume in a fresh Trainer to step 10, under flatshard and under DDP
    (the same Lightning loop: its data position after a resume is Lightning's business, so
    the resumed run is compared with DDP's resumed run, step by step)."""
    runs = {}
    strategies = {"flat": lambda: flat(state_dict_type=state_dict_type)}
    if state_dict_type == "sharded":  # DDP's own checkpoint is the same file either way
        strategies["ddp"] = lambda: "ddp"
    for name, strategy in strategies.items():
        path = out / f"resume-{name}-{state_dict_type}.ckpt"
        first, t = fit(strategy(), 5, out)
        t.save_checkpoint(path)
        resumed, _ = fit(strategy(), 10, out, ckpt=str(path))
        runs[name] = first + resumed
    res = {**runs, "is_dir": (out / f"resume-flat-{state_dict_type}.ckpt").is_dir()}
    if state_dict_type == "full" and int(os.environ.get("LOCAL_RANK", 0)) == 0:
        path = out / "resume-flat-full.ckpt"
        saved = torch.load(path, weights_only=True)  # a plain Lightning file: no flatshard
        plain = LitGPT()
        plain.load_state_dict(saved["state_dict"])  # strict: every key, every shape
        res["full_optimizer_keys"] = sorted(saved["optimizer_states"][0]["state"])
        res["full_expected_keys"] = sorted(n for n, _ in LitGPT().named_parameters())
    return res


def fabric_losses(strategy, steps: int, out: Path, accumulate: int = 1, resume: bool = False):
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module():
        model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)  # before setup: re-pointed
    model, opt = fabric.setup(model, opt)
    data = fabric.setup_dataloaders(loader())
    state = {"model": model, "optimizer": opt, "step": 0}
    if resume:
        fabric.load(out / "fabric-ckpt", state)
    losses = []
    for i, (x, y) in enumerate(data):
        if i < state["step"] * accumulate:
            continue
        last = (i + 1) % accumulate == 0
        with fabric.no_backward_sync(model, enabled=not last):
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            fabric.backward(loss / accumulate)
        losses.append(loss.item())
        if last:
            fabric.clip_gradients(model, opt, max_norm=0.05)
            opt.step()
            opt.zero_grad()
            state["step"] += 1
            if state["step"] == steps // 2 and not resume:
                fabric.save(out / "fabric-ckpt", state)
            if state["step"] == steps:
                break
    return losses


def fabric_meta_init() -> dict:
    """``fabric.init_module(empty_init=True)``: built on meta, materialised unit by unit."""
    strategy = FabricFlatshardStrategy(policy=fs.wrap.by_type(Block), timeout=TIMEOUT)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = GPT(CFG)
    on_meta = all(p.device.type == "meta" for p in model.parameters())
    model = fabric.setup_module(model)
    x, y = next(iter(loader()))
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    return {
        "built_on_meta": on_meta,
        "materialised": all(p.device.type == "cpu" for p in model.parameters()),
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        "loss": loss.item(),
    }


def case_fabric(out: Path) -> dict:
    fab = FabricFlatshardStrategy(policy=fs.wrap.by_type(Block), timeout=TIMEOUT)
    return {
        "meta": fabric_meta_init(),
        "ddp": fabric_losses("ddp", 6, out, accumulate=2),
        "flat": fabric_losses(fab, 6, out, accumulate=2),
        "resumed": fabric_losses(
            FabricFlatshardStrategy(policy=fs.wrap.by_type(Block), timeout=TIMEOUT),
            6,
            out,
            accumulate=2,
            resume=True,
        ),
    }


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    results = {
        "trainer": case_trainer(out),
        "resume_sharded": case_resume(out, "sharded"),
        "resume_full": case_resume(out, "full"),
        "fabric": case_fabric(out),
    }
    rank = torch.distributed.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    exit_after_group()  # the trainers leave threads behind ([Note: the exit abort])


if __name__ == "__main__":
    main()
