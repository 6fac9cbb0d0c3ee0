"""``flatshard train --model.hf PATH``: any causal LM of transformers instead of the GPT.

``PATH`` holds a ``config.json`` (pre-training the architecture from random init) or a
``save_pretrained`` directory (fine-tuning from its weights). The model is built on the meta
device and sharded unit by unit (the policy: its ``_no_split_modules`` classes; the init: its
own ``_init_weights``), so it never exists in full on any rank; weights are then read
rank-sliced (``fs.load``: each rank reads only its fragments). Local files only, never a
download. Packed rows pass ``position_ids``, no attention mask and ``use_cache=False``:
transformers' masking then turns position resets into a block-diagonal causal mask, so
documents never attend across each other (with a KV cache it would not). Tokens are the
trainer's byte tokens (ids < 258): the vocabulary must hold them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import flatshard as fs
from flatshard.data.tokenizer import ByteTokenizer
from flatshard.integrations.common import no_split_policy
from flatshard.packing import PackedBatch

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def check_hf_dir(path: str) -> Path:
    """The directory, or a ``FileNotFoundError`` naming what is missing (no download)."""
    where = Path(path)
    if not (where / "config.json").is_file():
        raise FileNotFoundError(
            f"model.hf={path!r}: no config.json there. Pass a directory holding a transformers "
            "config.json (random init) or a save_pretrained directory (its weights); nothing "
            "is ever downloaded"
        )
    return where


def has_weights(path: Path) -> bool:
    return any((path / name).is_file() for name in WEIGHT_FILES)


def build_hf_model(path: str, seed: int, seq_len: int, **shard_kwargs) -> nn.Module:
    """The sharded transformers model, initialised identically on every rank."""
    from transformers import AutoConfig, AutoModelForCausalLM

    where = check_hf_dir(path)
    config = AutoConfig.from_pretrained(where, local_files_only=True)
    _check_fits(config, path, seq_len)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    fs.shard(model, policy=no_split_policy(model), **shard_kwargs)
    if has_weights(where):
        fs.load(where, model=model)  # rank-sliced: each rank reads its fragments' bytes
    return model


def _check_fits(config, path: str, seq_len: int) -> None:
    vocab, needed = getattr(config, "vocab_size", 0), ByteTokenizer().vocab_size
    if vocab < needed:
        raise ValueError(
            f"model.hf={path!r} has vocab_size={vocab}, below the trainer's {needed} byte "
            f"tokens; use a config with vocab_size >= {needed}"
        )
    positions = getattr(config, "max_position_embeddings", None) or getattr(
        config, "n_positions", 0
    )
    if positions and positions < seq_len:
        raise ValueError(
            f"data.seq_len={seq_len} exceeds model.hf={path!r}'s {positions} positions; "
            f"pass --data.seq_len {positions} or less"
        )


def is_hf(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model, "_init_weights")


def logits(model: nn.Module, b: PackedBatch) -> torch.Tensor:
    """``[rows, seq_len, vocab]`` logits of a packed micro-batch, for the GPT or an HF model."""
    if is_hf(model):
        # no KV cache: transformers builds the packed (block-diagonal) mask only without one
        out = model(input_ids=b.input_ids, position_ids=b.position_ids, use_cache=False)
        return out.logits
    return model(b.input_ids, b.position_ids, b.cu_seqlens, b.max_seqlen)


def num_params(model: nn.Module) -> int:
    """Parameters of the unsharded model (tied ones once)."""
    if not is_hf(model):
        return model.num_params()
    return sum(fs.full_shape(p).numel() for p in model.parameters())


def flops_per_token(model: nn.Module, attention_length: float) -> float:
    """Training FLOPs per token: 6 per parameter plus the attention scores (as the GPT's)."""
    if not is_hf(model):
        return model.flops_per_token(attention_length)
    cfg = model.config
    layers = getattr(cfg, "num_hidden_layers", 0) or getattr(cfg, "n_layer", 0)
    width = getattr(cfg, "hidden_size", 0) or getattr(cfg, "n_embd", 0)
    return 6 * num_params(model) + 12 * layers * width * attention_length


@torch.no_grad()
def generate(model: nn.Module, ids: torch.Tensor, tokens: int, temperature: float,
             top_k: int, generator: torch.Generator) -> torch.Tensor:  # fmt: skip
    """Top-k sampling, one full forward per token (every rank the same, each forward gathers)."""
    if not is_hf(model):
        return model.generate(ids, tokens, temperature=temperature, top_k=top_k,
                              generator=generator)  # fmt: skip
    out = ids
    for _ in range(tokens):
        last = model(input_ids=out[None]).logits[0, -1].float() / temperature
        kth = torch.topk(last, min(top_k, last.numel())).values[-1]
        probs = torch.softmax(last.masked_fill(last < kth, float("-inf")), dim=-1)
        out = torch.cat([out, torch.multinomial(probs, 1, generator=generator)])
    return out
