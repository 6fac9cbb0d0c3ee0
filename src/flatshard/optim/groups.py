"""``fs.optim.param_groups``: weight-decay groups by the original shapes and module kinds;
``fs.optim.muon_split``: the matrices Muon takes and the rest.

The usual recipe (nanoGPT, HF Trainer, torchtitan's variants) decays matrices and leaves
biases, norm weights, embeddings and every other 1-D tensor alone. Written as
``p.dim() >= 2`` it finds nothing after ``fs.shard`` (fragments are 1-D); this helper applies
the rule to the original parameters, by their full shape and the module that registers them.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from flatshard.core.params import full_shape

NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.modules.batchnorm._NormBase,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)


def is_norm(module: nn.Module) -> bool:
    """torch's norm layers, and any class whose name ends in "Norm" (LlamaRMSNorm, ...)."""
    return isinstance(module, NORM_TYPES) or type(module).__name__.endswith("Norm")


def param_groups(
    model: nn.Module,
    weight_decay: float,
    *,
    decay_embeddings: bool = False,
    **options: Any,
) -> list[dict[str, Any]]:
    """Two optimizer param groups of ``model``'s trainable parameters: ``weight_decay`` for
    the matrices, 0.0 for biases, norm weights, embeddings (unless ``decay_embeddings``, as
    nanoGPT does) and anything with fewer than 2 dimensions in its *full* shape. A parameter
    tied between an embedding and a linear layer counts as an embedding. ``options`` (lr,
    betas, ...) go into both groups. Works on sharded and plain models alike.
    """
    kinds: dict[int, set[str]] = {}
    for module in model.modules():
        kind = "norm" if is_norm(module) else "embedding" if _is_embedding(module) else "other"
        for name, p in module._parameters.items():
            if p is not None:
                kinds.setdefault(id(p), set()).add("bias" if name == "bias" else kind)
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        plain = kinds.get(id(p), set()) & {"bias", "norm"} or len(full_shape(p)) < 2
        if not decay_embeddings and "embedding" in kinds.get(id(p), set()):
            plain = True
        (no_decay if plain else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay, **options},
        {"params": no_decay, "weight_decay": 0.0, **options},
    ]


def _is_embedding(module: nn.Module) -> bool:
    return isinstance(module, nn.Embedding | nn.EmbeddingBag)


HEAD_NAMES = ("lm_head", "head", "output", "classifier", "score", "embed_out")


def muon_split(
    model: nn.Module, *, head_names: tuple[str, ...] = HEAD_NAMES
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(matrices, others)`` of ``model``'s trainable parameters, as Muon's authors recommend:
    ``matrices`` (for ``fs.optim.Muon``) are the hidden layers' 2-D parameters by *full*
    shape; ``others`` (for AdamW) are embeddings (and anything tied to one), the output head
    (a module whose own name is in ``head_names``) and every parameter that is not 2-D.
    Works on sharded and plain models alike."""
    others: set[int] = set()
    for name, module in model.named_modules():
        if _is_embedding(module) or name.rsplit(".", 1)[-1] in head_names:
            others.update(id(p) for p in module.parameters(recurse=False))
    matrices, rest = [], []
    for p in model.parameters():
        if p.requires_grad:
            whole = len(full_shape(p)) == 2 and id(p) not in others
            (matrices if whole else rest).append(p)
    return matrices, rest
