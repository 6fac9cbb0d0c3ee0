"""Activation checkpointing by every route a torch FSDP2 user has, each against the unsharded run.

Each check changes a copy of the base GPT (or of a tiny Hugging Face Llama) the way the
third-party code does, shards it with flatshard and compares one AdamW step and the next loss
with the unsharded model, which keeps its activations (``step_parity``: checkpointing must not
change a gradient). The routes: ``torch.utils.checkpoint.checkpoint(block, ...)`` from the
parent's forward (non-reentrant and reentrant), torch's composable ``checkpoint(block)``,
``apply_activation_checkpointing`` and ``checkpoint_wrapper`` (reentrant impl), and Hugging
Face's ``gradient_checkpointing_enable()`` (the version's default and ``use_reentrant=True``;
skipped, with the reason, when transformers does not import). Same routes as the test-suite's
``tests/checkpoint_routes.py``, on flatshard's GPT here.
"""

from __future__ import annotations

import copy
import warnings

import torch
from gpu_check_common import Ctx, lm_loss, step_parity
from torch import nn
from torch.utils.checkpoint import checkpoint

import flatshard as fs
from flatshard.models import Block


class _CheckpointedCall(Block):
    """A Block whose parent's ``block(x, ...)`` runs as ``checkpoint(block, x, ...,
    use_reentrant=...)``: the user's own loop, without editing ``GPT.forward``. The module's
    ``__call__`` (flatshard's hooks included) runs inside the checkpointed region."""

    use_reentrant = False

    def __call__(self, *args):
        if not torch.is_grad_enabled():  # evaluation: nothing to recompute
            return super().__call__(*args)
        return checkpoint(super().__call__, *args, use_reentrant=self.use_reentrant)


def _around(reentrant: bool):
    def apply(model: nn.Module) -> None:
        for block in model.layers:
            block.__class__ = _CheckpointedCall
            block.use_reentrant = reentrant

    return apply


def _checked(model: nn.Module, ref: nn.Module, layer: type, x, x2, loss_fn=lm_loss) -> dict:
    """``step_parity``, and that every ``layer``'s MLP was entered 3 times: forward, its
    recompute in backward, the next loss (no grad): the route really checkpoints. (A pre-hook:
    non-reentrant recomputation stops once the last saved tensor is back, inside the MLP.)"""
    calls = [0]
    layers = [m for m in model.modules() if isinstance(m, layer)]
    for m in layers:
        m.mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    out = step_parity(model, ref, x, x2, loss_fn=loss_fn)
    out.update(mlp_calls=calls[0], recomputed=calls[0] == 3 * len(layers) > 0)
    out["ok"] = out["ok"] and out["recomputed"]
    return out


def _route_parity(c: Ctx, before) -> dict:
    return _checked(c.sharded(before), c.ref(), Block, c.x, c.x2)


def check_ckpt_torch_nonreentrant(c: Ctx) -> dict:
    return _route_parity(c, _around(False))


def check_ckpt_torch_reentrant(c: Ctx) -> dict:
    return _route_parity(c, _around(True))


def check_ckpt_composable(c: Ctx) -> dict:
    from torch.distributed._composable import checkpoint as composable_checkpoint

    def apply(model: nn.Module) -> None:
        for block in model.layers:
            composable_checkpoint(block)

    return _route_parity(c, apply)


def check_ckpt_apply_wrapper(c: Ctx) -> dict:
    """``apply_activation_checkpointing`` (non-reentrant CheckpointWrapper), the Blocks units."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    def apply(model: nn.Module) -> None:
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))

    return _route_parity(c, apply)


def check_ckpt_wrapper_reentrant(c: Ctx) -> dict:
    """``checkpoint_wrapper(block, CheckpointImpl.REENTRANT)`` in place of each block."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    def apply(model: nn.Module) -> None:
        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.REENTRANT)

    with warnings.catch_warnings():  # the wrapper checkpoints under no_grad too (the next loss)
        warnings.filterwarnings("ignore", "None of the inputs have requires_grad")
        return _route_parity(c, apply)


def _tiny_llama(c: Ctx):
    """A 2-layer LlamaForCausalLM (fp32, seeded) and its decoder-layer class."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = transformers.LlamaConfig(
        vocab_size=c.cfg.vocab_size, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=c.seq + 1,
        use_cache=False, initializer_range=0.2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train(), LlamaDecoderLayer


def _hf_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss  # HF shifts the labels itself


def _hf_route(c: Ctx, kwargs: dict | None) -> dict:
    try:
        import transformers
    except Exception as e:  # an optional extra: a skip, not a failure
        return {"skipped": f"transformers does not import: {type(e).__name__}: {e}"}
    base, layer = _tiny_llama(c)
    ref, model = copy.deepcopy(base).to(c.device), copy.deepcopy(base)
    with warnings.catch_warnings():  # transformers 5 deprecates the name, still the entry point
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model = fs.shard(model, policy=fs.wrap.by_type(layer))
    out = _checked(model, ref, layer, c.x, c.x2, loss_fn=_hf_loss)  # vocab: the GPT's
    out["transformers"] = transformers.__version__
    return out


def check_ckpt_hf_llama_default(c: Ctx) -> dict:
    """``gradient_checkpointing_enable()`` with the installed transformers' default kwargs."""
    return _hf_route(c, None)


def check_ckpt_hf_llama_reentrant(c: Ctx) -> dict:
    return _hf_route(c, {"use_reentrant": True})


ROUTE_CHECKS = [check_ckpt_torch_nonreentrant, check_ckpt_torch_reentrant]
ROUTE_CHECKS += [check_ckpt_composable, check_ckpt_apply_wrapper, check_ckpt_wrapper_reentrant]
ROUTE_CHECKS += [check_ckpt_hf_llama_default, check_ckpt_hf_llama_reentrant]
