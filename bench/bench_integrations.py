"""Step time of each trainer integration against plain flatshard on the same model.

Run (world 2, gloo, CPU):
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 bench/bench_integrations.py \
        [--rounds 3] [--steps 12] [--dim 128 --layers 4]

Two pairs, the same model, data, optimizer and sharding within a pair:
- a flatshard GPT: a plain loop (``fs.shard`` + AdamW) vs ``lightning.Trainer`` with
  ``FlatshardStrategy`` vs ``lightning.Fabric`` with its ``FlatshardStrategy``;
- a Llama from a config: a plain loop vs ``FlatshardTrainer``.
Every round runs every mode once (order rotated); a mode's time is the median optimizer-step
time of its run without the first two steps (Lightning: batch start to batch end, HF: step
begin to step end, both including the optimizer step), taken on rank 0 between the steps'
own collectives. Reported: medians over rounds and the ratio to the plain loop.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import flatshard as fs
from flatshard.comm.shutdown import exit_after_group
from flatshard.models import GPT, GPTConfig
from flatshard.models.block import Block

WARMUP = 2


def gpt_config(a) -> GPTConfig:
    return GPTConfig(vocab_size=256, d_model=a.dim, n_layers=a.layers, n_heads=4, max_seq_len=64)


def data(a) -> DataLoader:
    ids = torch.randint(
        0, 256, (a.steps * 4 * 2, a.seq + 1), generator=torch.Generator().manual_seed(0)
    )
    return DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=4)


def lm_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def timed_steps(batches, step, steps: int) -> list[float]:
    """Seconds of ``step(batch)`` for the first ``steps`` batches, warm-up dropped."""
    times = []
    for batch in batches:
        t0 = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - t0)
        if len(times) == steps:
            break
    return times[WARMUP:]


def plain_step(model, opt, loss: torch.Tensor) -> None:
    """A plain flatshard step: backward, the global clip, the optimizer."""
    loss.backward()
    fs.clip_grad_norm_(model, 1.0)
    opt.step()
    opt.zero_grad()


def plain_gpt(a) -> list[float]:
    torch.manual_seed(0)
    model = fs.shard(GPT(gpt_config(a)), policy=fs.wrap.by_type(Block))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    # the rank's share, as a DistributedSampler would deal it
    mine = (b for i, b in enumerate(data(a)) if i % world == rank)
    return timed_steps(mine, lambda b: plain_step(model, opt, lm_loss(model(b[0]), b[1])), a.steps)


def lightning_gpt(a) -> list[float]:
    import lightning as L

    from flatshard.integrations.lightning import FlatshardStrategy

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT(gpt_config(a))

        def training_step(self, batch, idx):
            return lm_loss(self.model(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    timer = _LightningTimer()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=FlatshardStrategy(policy=fs.wrap.by_type(Block)),
        max_steps=a.steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, gradient_clip_val=1.0, callbacks=[timer],
    )  # fmt: skip
    trainer.fit(Lit(), data(a))
    return timer.times[WARMUP:]


class _LightningTimer:
    """A Lightning callback without importing Lightning at module import."""

    def __new__(cls):
        import lightning as L

        class Timer(L.Callback):
            def __init__(self):
                self.times, self.t0 = [], 0.0

            def on_train_batch_start(self, *args):
                self.t0 = time.perf_counter()

            def on_train_batch_end(self, *args):
                self.times.append(time.perf_counter() - self.t0)

        return Timer()


def fabric_gpt(a) -> list[float]:
    import lightning as L

    from flatshard.integrations.lightning import FabricFlatshardStrategy

    fabric = L.Fabric(accelerator="cpu", devices=2,
                      strategy=FabricFlatshardStrategy(policy=fs.wrap.by_type(Block)))  # fmt: skip
    fabric.launch()
    torch.manual_seed(0)
    model = GPT(gpt_config(a))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = fabric.setup(model, opt)

    def step(batch) -> None:
        fabric.backward(lm_loss(model(batch[0]), batch[1]))
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad()

    return timed_steps(fabric.setup_dataloaders(data(a)), step, a.steps)


def llama(a):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=a.dim, intermediate_size=2 * a.dim,
                         num_hidden_layers=a.layers, num_attention_heads=4)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def plain_llama(a) -> list[float]:
    from flatshard.integrations.common import no_split_policy

    model = llama(a)
    fs.shard(model, policy=no_split_policy(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = (torch.randint(0, 256, (4, a.seq)) for _ in range(a.steps))
    step = lambda ids: plain_step(model, opt, model(input_ids=ids, labels=ids).loss)  # noqa: E731
    return timed_steps(batches, step, a.steps)


def hf_llama(a, out: str) -> list[float]:
    from transformers import TrainerCallback, TrainingArguments

    from flatshard.integrations.transformers import FlatshardTrainer

    class Timer(TrainerCallback):
        times, t0 = [], 0.0

        def on_step_begin(self, *args, **kwargs):
            Timer.t0 = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            Timer.times.append(time.perf_counter() - Timer.t0)

    ids = torch.randint(0, 256, (a.steps * 8, a.seq))
    dataset = [{"input_ids": r, "labels": r} for r in ids]
    args = TrainingArguments(output_dir=out, max_steps=a.steps, per_device_train_batch_size=4,
                             save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                             logging_steps=10**6, max_grad_norm=1.0)  # fmt: skip
    Timer.times = []
    FlatshardTrainer(model=llama(a), args=args, train_dataset=dataset, callbacks=[Timer()]).train()
    return Timer.times[WARMUP:]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--out", default="/tmp/bench_integrations")
    a = p.parse_args()
    a.steps = max(a.steps, WARMUP + 1)
    warnings.filterwarnings("ignore")
    torch.distributed.init_process_group("gloo")
    torch.set_num_threads(1)
    modes = {"plain_gpt": plain_gpt, "lightning": lightning_gpt, "fabric": fabric_gpt,
             "plain_llama": plain_llama, "hf_trainer": lambda a: hf_llama(a, a.out)}  # fmt: skip
    medians: dict[str, list[float]] = {m: [] for m in modes}
    names = list(modes)
    for r in range(a.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            medians[name].append(statistics.median(modes[name](a)) * 1e3)
    if torch.distributed.get_rank() == 0:
        shape = f"d={a.dim} L={a.layers}, 4x{a.seq} tokens per rank"
        print(f"world 2, GPT/Llama {shape}, {a.rounds} rounds")
        base = {"lightning": "plain_gpt", "fabric": "plain_gpt", "hf_trainer": "plain_llama"}
        for name, values in medians.items():
            m = statistics.median(values)
            ratio = (
                f"  {m / statistics.median(medians[base[name]]):.3f}x {base[name]}"
                if name in base
                else ""
            )
            print(
                f"{name:12s} {m:8.1f} ms/step (min {min(values):.1f}, max {max(values):.1f}){ratio}"
            )
    exit_after_group()  # Lightning and the HF Trainer leave threads behind ([Note: the exit abort])


if __name__ == "__main__":
    main()
