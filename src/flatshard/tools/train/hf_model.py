"""``flatshard train --model.hf PATH``: any causal LM of transformers instead of the GPT.

``PATH`` holds a ``config.json`` (pre-training the architecture from random init) or a
``save_pretrained`` directory (fine-tuning from its weights). The model is built on the meta
device and sharded unit by unit (the policy: its ``_no_split_modules`` classes; the init: its
own ``_init_weights``), so it never exists in full on any rank; weights are then read
rank-sliced (``fs.load``: each rank reads only its fragments). Local files only, never a
download. Packed rows pass ``position_ids``, no attention mask and ``use_cache=False``:
transformers' masking then turns position resets into a block-diagonal causal mask, so
documents never attend across each other (with a KV cache it would not). Tokens come from
the directory's own tokenizer when it has one (``tokenizer.json`` / ``tokenizer_config.json``:
fine-tuning a model in its own vocabulary); otherwise they are the trainer's byte tokens
(ids < 258), which the vocabulary must hold.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import flatshard as fs
from flatshard.integrations.common import no_split_policy
from flatshard.packing import PackedBatch

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class HFTokenizer:
    """A transformers tokenizer behind the trainer's tokenizer interface (``tools/train/data.py``):
    no special tokens added, ``eos_id`` appended per document, ``pad_id`` = its pad token
    (or eos: padded positions carry no target either way)."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if self.tok.eos_token_id is None:
            raise ValueError(
                f"model.hf={str(path)!r}: its tokenizer has no eos token, which separates the "
                "packed documents; set eos_token in its tokenizer_config.json"
            )
        self.eos_id = int(self.tok.eos_token_id)
        pad = self.tok.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id
        self.vocab_size = len(self.tok)
        self.name = f"{type(self.tok).__name__} from {path}"

    def encode(self, text: str, add_eos: bool = True) -> list[int]:
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return [*ids, self.eos_id] if add_eos else list(ids)

    def encode_documents(self, docs, *, add_eos: bool = True) -> list[list[int]]:
        batch = self.tok(list(docs), add_special_tokens=False)["input_ids"]
        return [[*ids, self.eos_id] if add_eos else list(ids) for ids in batch]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def tokenizer_for(path: str):
    """The run's tokenizer: ``path``'s own if it has one, else the byte tokenizer."""
    from flatshard.tools.train.data import TOKENIZER

    if path and any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        return HFTokenizer(Path(path))
    return TOKENIZER


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


def build_hf_model(
    path: str, seed: int, seq_len: int, vocab_needed: int, *, tp_mesh=None, **shard_kwargs
) -> nn.Module:
    """The sharded transformers model, initialised identically on every rank; made
    tensor-parallel first (``parallelize_hf``) when ``tp_mesh`` is given: the job's mesh
    with a ``"tp"`` dim (as tools/train/build.py passes it) or the 1-D tensor-parallel mesh."""
    from transformers import AutoConfig, AutoModelForCausalLM

    where = check_hf_dir(path)
    config = AutoConfig.from_pretrained(where, local_files_only=True)
    _check_fits(config, path, seq_len, vocab_needed)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if tp_mesh is not None:
        from flatshard.models.tensor_parallel import parallelize_hf

        parallelize_hf(model, tp_mesh["tp"] if tp_mesh.ndim > 1 else tp_mesh)
    fs.shard(model, policy=no_split_policy(model), **shard_kwargs)
    if has_weights(where):
        try:
            fs.load(where, model=model)  # rank-sliced: each rank reads its fragments' bytes
        except NotImplementedError as e:
            raise ValueError(
                f"model.hf={path!r}: its weights cannot be read into a tensor-parallel model "
                f"yet ({e}); fine-tune it with --parallelism.tp 1, or pre-train from a "
                "directory holding only config.json"
            ) from None
    return model


def _check_fits(config, path: str, seq_len: int, needed: int) -> None:
    vocab = getattr(config, "vocab_size", 0)
    if vocab < needed:
        raise ValueError(
            f"model.hf={path!r} has vocab_size={vocab}, below the {needed} ids of its tokens "
            f"(its tokenizer's, or the trainer's bytes when the directory has none); use a "
            f"config with vocab_size >= {needed}"
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
