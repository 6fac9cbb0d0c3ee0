"""Every Hugging Face Trainer case in one launch, under torchrun at world 2:
``torchrun --nproc-per-node 2 hf_run.py OUT_DIR``; each rank writes ``OUT_DIR/rank<r>.json``.

A tiny Llama built from a config (no downloads) trains 20 steps under the stock ``Trainer``
(DDP through Accelerate) and under ``FlatshardTrainer``, from the same seed and data, with
gradient accumulation and clipping; then a resume from ``checkpoint-10``, ``save_model`` read
back by ``from_pretrained``, gradient checkpointing, and bf16.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import flatshard as fs
from flatshard.comm.shutdown import exit_after_group
from flatshard.integrations.transformers import FlatshardTrainer

CONFIG = LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=32,
)


class Tokens(Dataset):
    def __init__(self, n: int = 160, seq: int = 8) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, CONFIG.vocab_size, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(CONFIG)


def args(out: Path, steps: int = 20, **kwargs) -> TrainingArguments:
    base = dict(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_grad_norm=0.1,
        learning_rate=3e-3,
        lr_scheduler_type="linear",
        warmup_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        data_seed=0,
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    return TrainingArguments(**{**base, **kwargs})


def losses(trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def run(cls, out: Path, resume: str | None = None, **kwargs) -> tuple[list[float], object]:
    trainer = cls(model=model(), args=args(out, **kwargs), train_dataset=Tokens())
    trainer.train(resume_from_checkpoint=resume)
    return losses(trainer), trainer


def word_tokenizer():
    """A word-level tokenizer built in code (TRL's SFTTrainer wants one; nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(60)} | {"<pad>": 60, "<eos>": 61, "<unk>": 62}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def sft_losses(out: Path) -> tuple[list[float], list[float]]:
    """TRL's SFTTrainer (text dataset, its own tokenisation and collator) under DDP and as
    ``class FlatshardSFTTrainer(FlatshardTrainerMixin, SFTTrainer)``."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from flatshard.integrations.transformers import FlatshardTrainerMixin

    class FlatshardSFTTrainer(FlatshardTrainerMixin, SFTTrainer):
        pass

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 12, (64,), generator=g).tolist()
    texts = [
        " ".join(f"w{int(t)}" for t in torch.randint(0, 60, (n,), generator=g)) for n in lengths
    ]
    results = []
    for name, cls in (("sft_ddp", SFTTrainer), ("sft_flat", FlatshardSFTTrainer)):
        args = SFTConfig(
            output_dir=str(out / name), max_steps=6, per_device_train_batch_size=2,
            learning_rate=3e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
            seed=0, max_length=16, disable_tqdm=True, bf16=False,
        )  # fmt: skip
        trainer = cls(model=model(), args=args, train_dataset=Dataset.from_dict({"text": texts}),
                      processing_class=word_tokenizer())  # fmt: skip
        trainer.train()
        results.append(losses(trainer))
    return results[0], results[1]


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    res: dict = {}
    res["ddp"], t = run(Trainer, out / "ddp")
    res["ddp_grad_norms"] = [e["grad_norm"] for e in t.state.log_history if "grad_norm" in e]
    res["flat"], t = run(FlatshardTrainer, out / "flat", save_strategy="steps", save_steps=10)
    res["grad_norms"] = [e["grad_norm"] for e in t.state.log_history if "grad_norm" in e]
    res["resumed"], _ = run(  # the log history of steps 1-10 comes back from the checkpoint
        FlatshardTrainer, out / "flat", resume=str(out / "flat/checkpoint-10")
    )
    t.save_model(str(out / "final"))
    full = fs.full_state_dict(t.model)
    if dist.get_rank() == 0:
        loaded = LlamaForCausalLM.from_pretrained(str(out / "final"))
        res["from_pretrained_err"] = max(
            (loaded.state_dict()[k] - v).abs().max().item() for k, v in full.items()
        )
        res["checkpoint_files"] = sorted(p.name for p in (out / "flat/checkpoint-10").iterdir())
    res["gc"], _ = run(FlatshardTrainer, out / "gc", steps=4, gradient_checkpointing=True)
    res["ddp_bf16"], _ = run(Trainer, out / "ddpbf16", steps=4, bf16=True)
    res["flat_bf16"], _ = run(FlatshardTrainer, out / "flatbf16", steps=4, bf16=True)
    res["sft_ddp"], res["sft_flat"] = sft_losses(out)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(res))
    exit_after_group()  # the trainers leave threads behind ([Note: the exit abort])


if __name__ == "__main__":
    main()
