"""``flatshard train --model.hf DIR``: transformers causal LMs from a config.json (random init,
on the meta device) and from a save_pretrained directory (its weights), on 2 CPU ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

TRAIN = [
    "--nproc", "2", "--data.seq_len", "64", "--data.rows", "2", "--precision.param_dtype",
    "fp32", "--optim.warmup_steps", "2", "--optim.lr", "3e-3", "--log.every", "5",
    "--log.val_batches", "1", "--log.plot_every", "0", "--log.sample_tokens", "4",
    "--checkpoint.enabled", "false",
]  # fmt: skip


def _train(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "flatshard.tools.cli", "train", *TRAIN, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def _losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows]


def _bpe_tokenizer():
    """A byte-level BPE of 300 ids trained in code on the embedded corpus (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from flatshard.data import embedded_documents

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(embedded_documents()[:300], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def _configs(root: Path) -> dict[str, Path]:
    from transformers import GPT2Config, Qwen2Config

    qwen = Qwen2Config(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    gpt2 = GPT2Config(vocab_size=264, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    dirs = {}
    for name, config in (("qwen2", qwen), ("gpt2", gpt2)):
        config.save_pretrained(root / name)
        dirs[name] = root / name
    _bpe_tokenizer().save_pretrained(root / "qwen2")  # Qwen2 trains on its own tokenizer
    return dirs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("train_hf")
    results = {}
    for name, config_dir in _configs(root).items():
        out = root / f"out-{name}"
        proc = _train("--model.hf", str(config_dir), "--steps", "20", "--out", str(out))
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        results[name] = (out, _losses(out), proc.stdout)
    qwen_out = results["qwen2"][0]  # fine-tune from the run's own save_pretrained export
    tuned = _train("--model.hf", str(qwen_out / "hf"), "--steps", "1", "--out", str(root / "ft"))
    assert tuned.returncode == 0, tuned.stdout[-2000:] + tuned.stderr[-4000:]
    results["finetune"] = (root / "ft", _losses(root / "ft"), tuned.stdout)
    return results


# The module's three training launches cost ~40 s: .ci/run's slow pass runs them.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2", "gpt2"])
def test_pretraining_from_a_config_lowers_the_loss(runs, name):
    out, losses, stdout = runs[name]
    assert len(losses) == 20
    assert losses[-1] < losses[0] - 0.5, losses
    assert "ForCausalLM" in stdout or "LMHeadModel" in stdout  # the header names the model
    assert (out / "hf" / "config.json").is_file() and (out / "hf" / "model.safetensors").is_file()
    # Qwen2's directory has a tokenizer: the run uses it and exports it; GPT-2's has none
    assert ("Tokenizer from" in stdout) == (name == "qwen2")
    assert ("byte tokens" in stdout) == (name == "gpt2")
    assert (out / "hf" / "tokenizer.json").is_file() == (name == "qwen2")


@pytest.mark.slow
def test_finetuning_starts_from_the_saved_weights(runs):
    _, pretrain, _ = runs["qwen2"]
    _, tuned, _ = runs["finetune"]
    # a fresh init starts at ~ln(320) = 5.8; the loaded weights (and the exported tokenizer)
    # where pretraining ended
    assert tuned[0] < pretrain[0] - 0.5, (tuned, pretrain)


def test_a_missing_directory_is_one_clear_error(tmp_path):
    proc = _train("--model.hf", str(tmp_path / "nowhere"), "--steps", "1", "--out", str(tmp_path))
    assert proc.returncode != 0
    assert "no config.json" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_packed_rows_do_not_attend_across_documents(tmp_path, arch):
    """What --model.hf relies on: position_ids that restart per document (no attention mask,
    no KV cache) make transformers build a block-diagonal causal mask."""
    from collections import namedtuple

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from flatshard.tools.train import hf_model

    Packed = namedtuple("Packed", "input_ids position_ids")  # the fields logits() reads

    config = AutoConfig.from_pretrained(_configs(tmp_path)[arch])
    config.vocab_size = 300
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    a, b = torch.randint(0, 258, (1, 5)), torch.randint(0, 258, (1, 7))
    packed = torch.cat([a, b], dim=1)
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with torch.no_grad():
        together = hf_model.logits(model, Packed(packed, positions))
        alone = torch.cat([model(input_ids=a).logits, model(input_ids=b).logits], dim=1)
    assert (together - alone).abs().max().item() < 1e-5
