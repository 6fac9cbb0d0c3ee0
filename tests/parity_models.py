"""Small models with the hard cases, and the parity harness that trains them sharded and not.

Each ``Case`` builds a model (deterministic under a seed), a wrap policy, a global batch for a
step, and the loss. ``train_parity`` trains a sharded copy on this rank's slice of every global
batch and a single-process copy on the whole global batch, both with AdamW, and reports the
largest relative difference of the full state dicts (rank 0) and of the losses.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import flatshard as fs

VOCAB, SEQ = 53, 12


class Block(nn.Module):
    """Pre-norm transformer block with odd sizes (d=24, heads=2, ff=37)."""

    def __init__(self, d: int = 24, heads: int = 2, ff: int = 37) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)  # a key bias has a zero gradient: noise
        self.proj = nn.Linear(d, d)
        self.mlp = MLP(d, ff)
        # ``checkpoint_fn(fn, x)`` around parts of this forward (activation checkpointing
        # inside a unit); ``checkpoint_parts``: "all" (one region), "both" (attention, then
        # mlp) or "mlp" (the attention keeps its activations).
        self.checkpoint_fn: Callable | None = None
        self.checkpoint_parts = "all"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_fn is None:
            return self._body(x)
        if self.checkpoint_parts == "all":
            return self.checkpoint_fn(self._body, x)
        if self.checkpoint_parts == "both":
            x = self.checkpoint_fn(self._attention, x)
        else:
            x = self._attention(x)
        return self.checkpoint_fn(self._mlp, x)

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return self._mlp(self._attention(x))

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return x + self.proj(a.transpose(1, 2).reshape(b, t, d))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.ln2(x))


class MLP(nn.Module):
    def __init__(self, d: int, ff: int) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class TinyGPT(nn.Module):
    """Embedding tied to the output head; ``tie_across_units`` moves the head into its own
    module so that a policy can put the two users of the tied weight in different units."""

    def __init__(self, layers: int = 3, d: int = 24) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(SEQ, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.lnf = nn.LayerNorm(d)
        self.head = Head(d)
        self.head.proj.weight = self.emb.weight
        # ``block_call(block, x)`` instead of ``block(x)``: activation checkpointing around
        # the blocks, from the parent's forward.
        self.block_call: Callable | None = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x) if self.block_call is None else self.block_call(block, x)
        return self.head(self.lnf(x))


class Head(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class LoRALinear(nn.Module):
    """A frozen base layer plus a trainable low-rank update, all in one unit."""

    def __init__(self, n_in: int, n_out: int, rank: int = 3) -> None:
        super().__init__()
        self.base = nn.Linear(n_in, n_out)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, n_in) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(n_out, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


class LoRAModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = LoRALinear(19, 23), LoRALinear(23, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(F.gelu(self.l1(x)))


class Branchy(nn.Module):
    """Unused parameters of every kind: a never-called unit, a called unit whose output is
    dropped, a parameter of a used unit that is not used, a used unit with a dead layer."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(13, 17), nn.Tanh())
        self.head = TwoLayers()
        self.never_called = Side(17, 5)
        self.output_dropped = Side(17, 5)
        self.spare = nn.Parameter(torch.randn(7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x)
        self.output_dropped(h)
        return self.head(h)


class Side(nn.Linear):
    """A branch layer, its own unit."""


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.dead = nn.Linear(17, 5), nn.Linear(17, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


class Reused(nn.Module):
    """One unit called twice per forward (weight sharing across depth, as in ALBERT)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(11, 72), Block(), nn.Linear(72, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).tanh().unflatten(-1, (3, 24))  # [rows, 3 tokens, 24]
        return self.out(self.block(self.block(h)).flatten(-2))


def _hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB,
        bos_token_id=0,
        eos_token_id=0,
        n_positions=SEQ + 1,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        initializer_range=0.2,
    )
    # std 0.2 rather than 0.02: with near-uniform attention the key weights get ~1e-8
    # gradients whose rounding noise AdamW amplifies past 1e-5, hiding real differences.
    return GPT2LMHeadModel(cfg)


# The small decoder every HF test model shares (std 0.2: see _hf_gpt2).
HF_SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=43,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=SEQ + 1,
    initializer_range=0.2,
)


def _hf_causal_lm(config_name: str, model_name: str, **overrides) -> nn.Module:
    import transformers

    config = getattr(transformers, config_name)(**{**HF_SMALL, **overrides})
    return getattr(transformers, model_name)(config)


def _hf_llama() -> nn.Module:
    return _hf_causal_lm(
        "LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2, tie_word_embeddings=False
    )


def _hf_qwen2() -> nn.Module:
    return _hf_causal_lm(
        "Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, tie_word_embeddings=True
    )


def _hf_neox() -> nn.Module:
    return _hf_causal_lm(
        "GPTNeoXConfig", "GPTNeoXForCausalLM", hidden_dropout=0.0, attention_dropout=0.0
    )


def _hf_layer_policy(module_name: str, class_name: str):
    def policy():
        import importlib

        cls = getattr(importlib.import_module(f"transformers.models.{module_name}"), class_name)
        return fs.wrap.by_type(cls)

    return policy


def _gpt2_policy():
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    return fs.wrap.by_type(GPT2Block)


def _llama_policy():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return fs.wrap.by_type(LlamaDecoderLayer)


def _tokens(gen: torch.Generator, rows: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ + 1), generator=gen)


def _lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def _hf_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def _regression(n_in: int) -> Callable:
    def make(gen: torch.Generator, rows: int) -> torch.Tensor:
        return torch.randn(rows, n_in + 1, generator=gen)

    return make


def _mse_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    out = model(batch[:, :-1])
    return (out - batch[:, -1:]).pow(2).mean()


@dataclass
class Case:
    build: Callable[[], nn.Module]
    policy: Callable[[], object]
    batch: Callable[[torch.Generator, int], torch.Tensor]
    loss: Callable[[nn.Module, torch.Tensor], torch.Tensor]


CASES: dict[str, Case] = {
    "gpt_tied": Case(TinyGPT, lambda: fs.wrap.by_type(Block), _tokens, _lm_loss),
    "gpt_tied_across_units": Case(
        TinyGPT, lambda: fs.wrap.by_type(Block, nn.Embedding, Head), _tokens, _lm_loss
    ),
    "gpt_nested_units": Case(TinyGPT, lambda: fs.wrap.by_type(Block, MLP), _tokens, _lm_loss),
    "gpt_by_size": Case(TinyGPT, lambda: fs.wrap.by_size(1500), _tokens, _lm_loss),
    "gpt_root_only": Case(TinyGPT, fs.wrap.root_only, _tokens, _lm_loss),
    "lora": Case(LoRAModel, lambda: fs.wrap.by_type(LoRALinear), _regression(19), _mse_loss),
    "unused": Case(
        Branchy, lambda: fs.wrap.by_type(nn.Sequential, Side, TwoLayers), _regression(13), _mse_loss
    ),
    "reused_unit": Case(Reused, lambda: fs.wrap.by_type(Block), _regression(11), _mse_loss),
    "hf_gpt2": Case(_hf_gpt2, _gpt2_policy, _tokens, _hf_loss),
    "hf_llama": Case(_hf_llama, _llama_policy, _tokens, _hf_loss),
    "hf_qwen2": Case(
        _hf_qwen2,
        _hf_layer_policy("qwen2.modeling_qwen2", "Qwen2DecoderLayer"),
        _tokens,
        _hf_loss,
    ),
    "hf_neox": Case(
        _hf_neox,
        _hf_layer_policy("gpt_neox.modeling_gpt_neox", "GPTNeoXLayer"),
        _tokens,
        _hf_loss,
    ),
}


def mesh_for(strategy: str):
    """hybrid_shard: a (replicate, shard) mesh with shard groups of 2; others: all ranks."""
    if strategy != "hybrid_shard":
        return None
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    return init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))


def named_param_groups(model: nn.Module) -> list[dict]:
    """Weight decay by name (as users do): biases and norms get none."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        plain = name.endswith("bias") or "ln" in name or "norm" in name
        (no_decay if plain else decay).append(p)
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to ``b``'s largest element; ``inf`` when either holds a
    NaN (``max(worst, nan)`` would otherwise keep ``worst`` and pass a NaN run)."""
    if not b.numel():
        return 0.0
    scale = b.abs().max().item()
    err = (a - b).abs().max().item() / max(scale, 1e-12)
    return err if err == err else float("inf")


# [Note: the noise floor]
# AdamW's first steps map a gradient g to about g / (|g| + eps): an element whose true gradient
# is zero or ~1e-7 of its tensor's largest (GPT-2's key bias is exactly zero: softmax ignores a
# constant added to every key) moves by a sign-and-size that is pure rounding noise, and any two
# summation orders (one process vs a reduce-scatter) disagree there by up to lr per step.
# Such elements are left out of the parameter comparison; the harness reports how many there
# were so a test can check that they are rare. Gradients themselves are compared everywhere.
NOISE_FLOOR = 1e-5


def train_parity(
    name: str,
    steps: int = 5,
    rows_per_rank: int = 2,
    strategy: str = "full_shard",
    recompute: bool | str = False,
    *,
    optimizer: Callable | None = None,
    micro_batches: int = 1,
    **shard_kwargs,
):
    """Per rank: dict(sd_err, loss_err, grad_err, none_mismatch, noisy_fraction); gradients
    are this rank's fragments, the state dict (``sd_err``) is compared on rank 0 only (0.0
    elsewhere).

    ``recompute``: True for ``fs.checkpoint_activations`` of the unit modules, or the name of
    an activation-checkpointing route of ``checkpoint_routes.ROUTES`` (applied to the sharded
    copy only; the reference keeps its activations). ``optimizer(param_groups)`` builds both
    optimizers (default AdamW). ``micro_batches`` > 1 accumulates them under ``fs.no_sync``."""
    from checkpoint_routes import ROUTES

    case = CASES[name]
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = case.build()
    route = ROUTES["fs_checkpoint_activations" if recompute is True else recompute or "none"]
    model = copy.deepcopy(ref)
    route.before_shard(model)
    policy = route.policy(case.policy())
    fs.shard(model, policy=policy, strategy=strategy, mesh=mesh_for(strategy), **shard_kwargs)
    route.after_shard(model, case.policy())
    make_opt = optimizer or (lambda groups: torch.optim.AdamW(groups, lr=1e-3))
    opt, ref_opt = make_opt(named_param_groups(model)), make_opt(named_param_groups(ref))
    loss_err, grad_err, none_mismatch = 0.0, 0.0, []
    noisy = {id(p): torch.zeros_like(p, dtype=torch.bool) for p in ref.parameters()}
    for step in range(steps):
        batch = case.batch(torch.Generator().manual_seed(step), rows_per_rank * world)
        local = batch.chunk(world)[rank]
        loss = _sharded_backward(model, case, local, micro_batches)
        ref_loss = case.loss(ref, batch)
        ref_loss.backward()
        none_mismatch += _grad_none_mismatches(model, ref)
        if step == 0:  # later steps start from params that differ at the noise floor
            grad_err = _max_grad_err(model, ref)
        _mark_noise_floor(ref, noisy)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        loss_err = max(loss_err, rel_err(mean_loss / world, ref_loss.detach()))
    full = fs.full_state_dict(model)
    ref_sd = ref.state_dict(keep_vars=True)
    if rank == 0:
        assert list(full) == list(ref_sd), f"keys differ: {list(full)} vs {list(ref_sd)}"
    sd_err = 0.0
    for key, value in ref_sd.items() if rank == 0 else ():
        keep = ~noisy[id(value)] if id(value) in noisy else torch.ones_like(value, dtype=torch.bool)
        sd_err = max(sd_err, rel_err(full[key][keep], value.detach()[keep]))
    total = sum(m.numel() for m in noisy.values())
    noisy_fraction = sum(m.sum().item() for m in noisy.values()) / max(total, 1)
    return dict(
        sd_err=sd_err,
        loss_err=loss_err,
        grad_err=grad_err,
        none_mismatch=none_mismatch,
        noisy_fraction=noisy_fraction,
    )


def state_dict_err(model: nn.Module, ref: nn.Module) -> float:
    """Rank 0: the largest relative difference between the sharded model's full state dict and
    the reference's (0.0 on other ranks). Every rank must call it (it gathers)."""
    full = fs.full_state_dict(model)
    return (
        max((rel_err(full[k], v) for k, v in ref.state_dict().items()), default=0.0)
        if full
        else 0.0
    )


def parity_step(model: nn.Module, ref: nn.Module, opts, batch: torch.Tensor, loss_fn) -> None:
    """One step of the parity pattern: the sharded model on this rank's slice of ``batch``,
    the reference on all of it, both optimizers (``opts = (opt, ref_opt)``) step and zero."""
    world, rank = dist.get_world_size(), dist.get_rank()
    loss_fn(model, batch.chunk(world)[rank]).backward()
    loss_fn(ref, batch).backward()
    for opt in opts:
        opt.step()
        opt.zero_grad()


def check_parity(results: list[dict], label: str, tolerance: float = 1e-5) -> None:
    """Assert ``train_parity``'s per-rank results: every rank's gradients and None-ness, rank
    0's state dict and losses, and a rare noise floor."""
    for rank, r in enumerate(results):
        assert r["none_mismatch"] == [], f"{label} rank {rank}: None-ness {r['none_mismatch']}"
        assert r["grad_err"] <= tolerance, f"{label} rank {rank}: grad err {r['grad_err']:.2e}"
    r = results[0]
    assert r["sd_err"] <= tolerance, f"{label}: params rel err {r['sd_err']:.2e}"
    assert r["loss_err"] <= tolerance, f"{label}: loss rel err {r['loss_err']:.2e}"
    assert r["noisy_fraction"] < 0.01, f"{label}: {r['noisy_fraction']:.1%} at the noise floor"


def _sharded_backward(model: nn.Module, case: Case, local: torch.Tensor, micro: int):
    """Backward of this rank's rows, split into ``micro`` micro-batches accumulated under
    ``fs.no_sync`` (the last one outside it); returns the loss of the whole slice."""
    if micro == 1:
        loss = case.loss(model, local)
        loss.backward()
        return loss
    total = torch.zeros(())
    for i, part in enumerate(local.chunk(micro)):
        context = fs.no_sync(model) if i < micro - 1 else contextlib.nullcontext()
        with context:
            loss = case.loss(model, part) / micro
            loss.backward()
        total += loss.detach()
    return total


def _mark_noise_floor(ref: nn.Module, noisy: dict) -> None:
    for p in ref.parameters():
        if p.grad is not None and p.grad.numel():
            magnitude = p.grad.abs()  # exact zeros are exact on both sides: not noise
            noisy[id(p)] |= (magnitude > 0) & (magnitude <= NOISE_FLOOR * magnitude.max())


def _max_grad_err(model: nn.Module, ref: nn.Module) -> float:
    """Largest relative error of this rank's gradient fragments against the reference's."""
    ref_params = dict(ref.named_parameters())
    names = {id(p): n for n, p in plain_named_parameters(model)}
    worst = 0.0
    for info in fs.fragment_info(model).values():
        frag = info.fragment
        if frag.grad is None or not frag.numel():
            continue
        full_grad = ref_params[names[id(frag)]].grad.reshape(-1)
        start, end = info.flat_range
        scale = full_grad.abs().max().item()
        err = (frag.grad - full_grad[start:end]).abs().max().item()
        worst = max(worst, err / max(scale, 1e-12))
    return worst


def _grad_none_mismatches(model: nn.Module, ref: nn.Module) -> list[str]:
    ref_params = dict(ref.named_parameters())
    return [
        name
        for name, p in plain_named_parameters(model)
        if (p.grad is None) != (ref_params[name].grad is None)
    ]


def plain_named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``named_parameters()`` without the prefix torch's ``CheckpointWrapper`` inserts (its
    state dict hooks drop it too)."""
    prefix = "_checkpoint_wrapped_module."
    return [(name.replace(prefix, ""), p) for name, p in model.named_parameters()]
