"""Fine-tune a tiny Llama with ``FlatshardTrainer``, the drop-in ``transformers.Trainer``.

    pip install -e ".[hf]"
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/hf_trainer.py

Built from a config, so nothing is downloaded; with a real model, pass
``AutoModelForCausalLM.from_pretrained(...)`` instead.
"""

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from flatshard.integrations.transformers import FlatshardTrainer


class Tokens(Dataset):
    def __init__(self, n: int = 256, seq: int = 32) -> None:
        self.ids = torch.randint(0, 128, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    args = TrainingArguments(
        output_dir="hf-flatshard", max_steps=30, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, learning_rate=3e-3, bf16=True, logging_steps=5,
        save_steps=15, gradient_checkpointing=True, report_to=[], use_cpu=True,
    )  # fmt: skip
    trainer = FlatshardTrainer(model=LlamaForCausalLM(config), args=args, train_dataset=Tokens())
    trainer.train()  # resume later with trainer.train(resume_from_checkpoint=True)
    trainer.save_model("hf-flatshard/final")  # AutoModelForCausalLM.from_pretrained loads it


if __name__ == "__main__":
    main()
