"""``flatshard train --model.hf DIR --parallelism.pp N``: a transformers causal LM cut into stages.

[Note: an HF stage reproduces the unsplit model's mask and positions]
Supported: the Llama layout (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MistralForCausalLM``:
``model.embed_tokens``, ``model.layers``, ``model.norm``, ``model.rotary_emb``, ``lm_head``, and
a decoder layer called as ``layer(x, attention_mask=, position_embeddings=, position_ids=)``).
A stage (:class:`HFStage`) holds the first stage's embedding, its share of the layers (an
``nn.ModuleDict`` keyed by the *global* layer index) and the last stage's norm and head, under
the unsplit model's names (``model.layers.3.mlp.up_proj.weight`` stays that), so checkpoints
read back at any pp or none (as [Note: whole-model names on every stage] for the GPT).

Every stage receives the packed rows' ``position_ids`` (no attention mask, no cache) and
recomputes what the unsplit ``LlamaModel.forward`` computes once at the bottom of the stack:

* **positions**: its own copy of ``rotary_emb`` turns ``position_ids`` into ``(cos, sin)``, so
  each document's tokens get positions from 0, as in the unsplit model;
* **mask**: transformers' own ``create_causal_mask`` (``create_sliding_window_causal_mask``
  for Qwen2's sliding layers and a Mistral with ``sliding_window``) on the same
  ``position_ids``, no attention mask and no cache. It finds the documents where consecutive
  positions do not step by 1 (``find_packed_sequence_indices``) and masks every pair of tokens
  from different documents: the same block-diagonal causal mask, whatever the stage.

The stages' input is the stage root's floating input cast to the compute dtype (``fs.shard``'s
mixed precision), the dtype the unsplit model's mask and rotary tables are built in.

Initialisation (pre-training from a ``config.json``): the unsplit path builds the model on the
meta device and ``fs.shard`` initialises it unit by unit (decoder layers in order, then the
root), each module with the model's ``_init_weights``, drawing from the one seeded generator.
A stage sees only some of those units, in another order; :func:`init_states` replays the
unsplit order once (one module's temporary storage at a time) and records the generator state
before each module, and the stage's ``init_fn`` restores it before initialising that module:
every weight gets the same numbers as in the unsplit run. Fine-tuning skips the replay and
reads each stage's weights rank-sliced (``fs.load``, ``strict=False``: the other stages' too).

[Note: tied embeddings in HF stages]
A model with ``tie_word_embeddings`` uses one matrix as ``model.embed_tokens.weight`` (first
stage) and ``lm_head.weight`` (last stage). The last stage gets its own copy of the head
(``TIED_HEAD``), so each stage shards a parameter of its own, and ``build_pipeline`` declares
the pair with ``fs.tie_across_stages``: every step both copies get the sum of the two uses'
gradients, as the one matrix does in the unsplit model. Both copies must start equal:

* **initialisation**: in the unsplit model ``fs.shard`` gives the shared matrix real storage
  once and runs the root unit's initialiser over it twice, the embedding's rule and then the
  head's (``lm_head`` comes after ``model`` among the root's children), so the head's draw is
  the value. The head's copy replays the head's draw; the first stage replays the
  embedding's and then the head's, on its embedding (``_stage_init``);
* **weights**: ``save_pretrained`` writes a tied matrix once, as
  ``model.embed_tokens.weight``. The last stage names that source for its copy
  (``_tied_weights_keys``, transformers' own mapping of a tied name to its source, which the
  weights loader follows for a name the file lacks);
* **checkpoints**: each stage saves its copy under its own name, so a checkpoint holds both,
  and an unpipelined tied model reads the first name and treats the other as its alias.

[Note: HF stages under TP]
With ``--parallelism.tp``, ``parallelize_hf`` makes the unsplit meta model tensor-parallel
before ``fs.shard`` (the stages hold its modules; a tied head's copy gets the head's plan,
``Shard(0)`` like the embedding). Under its sequence parallelism the residual stream is a
``Shard(1)`` DTensor whose shape is the global one, which transformers' masks and positions
read ([Note: RoPE and positions under SP] in models/tensor_parallel.py). Between stages it
travels as each tp rank's local sequence shard, ``[B, T / tp, C]`` (what torch's
``PipelineStage`` sends): a stage wraps what it receives back into the ``Shard(1)`` stream and
returns the local shard of its output; the last stage's head gathers the logits, so the loss
sees whole rows on every tp rank. From a config each TP parameter is drawn whole from the
replayed generator state and cut to its block (``core/meta_init.py``), so runs from a config
repeat the unsplit curve exactly, as runs from weights do.

Refused: other architectures, and a tp that does not divide the heads, the kv heads, the MLP
width or the vocabulary.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

import flatshard as fs
from flatshard.models.tensor_parallel import HF_SPLIT_SIZES
from flatshard.tools.train.config import TrainConfig

__all__ = [
    "SUPPORTED",
    "TIED_HEAD",
    "HFStage",
    "build_hf_stages",
    "hf_pp_error",
    "hf_ties",
    "init_states",
]

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
"""Classes whose layout and decoder-layer call :class:`HFStage` reproduces."""
TIED_HEAD = {"lm_head.weight": "model.embed_tokens.weight"}
"""A tied model's head -> the embedding it copies ([Note: tied embeddings in HF stages])."""


def _config(path: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(Path(path), local_files_only=True)


def _class_name(config: Any) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, type(config).__name__)


def hf_pp_error(cfg: TrainConfig, stages: int) -> str | None:
    """Why ``model.hf`` cannot be cut into ``stages`` stages, with the fix; None if it can."""
    p, path = cfg.parallel, cfg.model.hf
    config = _config(path)
    name = _class_name(config)
    if name not in SUPPORTED:
        return (f"model.hf={path!r} is a {name}: parallel.pp={p.pp} cuts only the Llama "
                f"layout ({', '.join(SUPPORTED)}); pass --parallelism.pp 1 for this "
                "model")  # fmt: skip
    if bad := [f"{k}={getattr(config, k)}" for k in HF_SPLIT_SIZES if getattr(config, k) % p.tp]:
        return (f"model.hf={path!r} cannot be split over parallel.tp={p.tp}: {', '.join(bad)} "
                "not divisible by it; pass a --parallelism.tp that divides them")  # fmt: skip
    layers = config.num_hidden_layers
    if stages > layers:
        return (f"{stages} pipeline stages need at least {stages} decoder layers, model.hf="
                f"{path!r} has num_hidden_layers={layers}: pass fewer stages "
                "(--parallelism.pp, --parallelism.stages_per_rank)")  # fmt: skip
    return None


def _mask_kinds(hf: nn.Module) -> list[str]:
    """The mask each global layer reads, as the unsplit model's forward picks it."""
    config, name = hf.config, type(hf).__name__
    n = config.num_hidden_layers
    if name == "Qwen2ForCausalLM":
        return list(config.layer_types[:n])
    if name == "MistralForCausalLM" and config.sliding_window is not None:
        return ["sliding_attention"] * n
    return ["full_attention"] * n


class HFStage(nn.Module):
    """Layers ``layers`` of the transformers model ``hf`` (taken, not copied), with its
    embedding when ``first`` and its final norm and head when ``last``; see [Note: an HF stage
    reproduces the unsplit model's mask and positions]."""

    def __init__(self, hf: nn.Module, layers: range, *, first: bool, last: bool) -> None:
        super().__init__()
        name = type(hf).__name__
        if name not in SUPPORTED:
            raise ValueError(
                f"{name} cannot be cut into pipeline stages: only {', '.join(SUPPORTED)}; "
                "train it with --parallelism.pp 1"
            )
        config = hf.config
        self.arch, self.width = name, config.hidden_size
        self.hf_config = config
        self.whole_params = 0  # the unsplit model's parameters (set by the builder)
        trunk = nn.Module()  # "model.": the unsplit model's names
        trunk.register_module("embed_tokens", hf.model.embed_tokens if first else None)
        trunk.layers = nn.ModuleDict({str(i): hf.model.layers[i] for i in layers})
        trunk.register_module("norm", hf.model.norm if last else None)
        trunk.rotary_emb = copy.deepcopy(hf.model.rotary_emb)  # buffers only: every stage
        self.model = trunk
        self.tied = hf.lm_head.weight is hf.model.embed_tokens.weight
        head = hf.lm_head if last else None
        if head is not None and self.tied and not first:
            head = copy.deepcopy(head)  # see [Note: tied embeddings in HF stages]
            self._tied_weights_keys = dict(TIED_HEAD)  # read by the weights loader
        self.register_module("lm_head", head)
        self.tp_mesh: Any = None  # set by _tensor_parallel: see [Note: HF stages under TP]
        kinds = _mask_kinds(hf)
        self.kinds = {i: kinds[i] for i in layers}

    def _masks(self, x: torch.Tensor, position_ids: torch.Tensor) -> dict[str, Any]:
        """The unsplit model's masks of these rows: transformers builds them from the
        position resets (no attention mask, no cache)."""
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        build = {
            "full_attention": create_causal_mask,
            "sliding_attention": create_sliding_window_causal_mask,
        }
        args = {"config": self.hf_config, "inputs_embeds": x, "attention_mask": None,
                "cache": None, "position_ids": position_ids}  # fmt: skip
        return {kind: build[kind](**args) for kind in set(self.kinds.values())}

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """``x``: ids ``[B, T]`` (first stage) or hidden ``[B, T, C]``; returns hidden
        ``[B, T, C]``, or logits ``[B, T, V]`` on the last stage."""
        trunk = self.model
        if trunk.embed_tokens is not None:
            x = trunk.embed_tokens(x)  # [B, T, C] (under TP a Shard(1) DTensor)
        elif self.tp_mesh is not None:  # the sequence shard a stage receives: the stream again
            x = DTensor.from_local(x, self.tp_mesh, [Shard(1)], run_check=False)
        masks = self._masks(x, position_ids)
        rope = trunk.rotary_emb(x, position_ids)  # (cos, sin), [B, T, D] each
        for key, layer in trunk.layers.items():
            x = layer(x, attention_mask=masks[self.kinds[int(key)]], position_embeddings=rope,
                      position_ids=position_ids, use_cache=False)  # fmt: skip
        if self.lm_head is not None:
            return self.lm_head(trunk.norm(x))  # [B, T, V] (under TP gathered, local)
        return x.to_local() if self.tp_mesh is not None else x  # its sequence shard


def _rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _post_order(module: nn.Module, skip: set[int]) -> Iterator[nn.Module]:
    """Children first, as ``fs.shard``'s initialiser applies ``_init_weights``; the subtrees
    in ``skip`` (other units: on the meta device then, they draw nothing) left out."""
    for child in module.children():
        if id(child) not in skip:
            yield from _post_order(child, skip)
    yield module


@torch.no_grad()
def _init_on_scratch(init: Callable[[nn.Module], None], module: nn.Module, device) -> None:
    """``init(module)`` on temporary storage for its own meta tensors, then meta again: the
    generator advances exactly as when ``fs.shard`` initialises it."""
    params, buffers = dict(module._parameters), dict(module._buffers)
    for key, p in params.items():
        if p is not None and p.device.type == "meta":
            scratch = torch.empty(p.shape, dtype=p.dtype, device=device)
            module._parameters[key] = nn.Parameter(scratch, requires_grad=p.requires_grad)
    for key, b in buffers.items():
        if b is not None and b.device.type == "meta":
            module._buffers[key] = torch.empty(b.shape, dtype=b.dtype, device=device)
    try:
        init(module)
    finally:
        module._parameters.update(params)
        module._buffers.update(buffers)


def init_states(hf: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """Module name -> the generator state before ``fs.shard`` initialises that module of the
    unsplit meta model ``hf`` (units: its decoder layers in order, then the root)."""
    names = {id(m): n for n, m in hf.named_modules()}
    layers = list(hf.model.layers)
    states: dict[str, torch.Tensor] = {}
    for unit in [*layers, hf]:
        others = {id(layer) for layer in layers if layer is not unit}
        for module in _post_order(unit, others):
            states[names[id(module)]] = _rng_state(device)
            _init_on_scratch(hf._init_weights, module, device)
    return states


def _stage_init(hf: nn.Module, stage: HFStage, states: dict, device) -> Callable:
    """``fs.shard``'s ``init_fn`` for ``stage``: each module initialised from the generator
    state the unsplit model's initialisation had there."""
    names = {id(m): n for n, m in hf.named_modules()}
    names[id(stage.model.rotary_emb)] = "model.rotary_emb"  # the stage's copy
    if stage.lm_head is not None:
        names[id(stage.lm_head)] = "lm_head"  # the tied head's copy, if it is one
    redraw = stage.tied and stage.lm_head is None and "lm_head" in states

    def init_unit(unit: nn.Module) -> None:
        for module in _post_order(unit, set()):
            name = names.get(id(module))
            if name is None:  # the stage's own containers: nothing to initialise
                continue
            if name in states:
                _set_rng_state(states[name], device)
            hf._init_weights(module)
            if name == "model.embed_tokens" and redraw:
                _head_draw_over(hf, module, states["lm_head"], device)

    return init_unit


def _head_draw_over(hf: nn.Module, embedding: nn.Module, state: torch.Tensor, device) -> None:
    """The unsplit model's last write to a tied matrix, on the first stage's embedding: the
    head's initialiser from the head's generator state ([Note: tied embeddings in HF
    stages])."""
    head, shared = hf.lm_head, hf.lm_head._parameters["weight"]
    head._parameters["weight"] = embedding.weight  # the head's rule, on the embedding's storage
    try:
        _set_rng_state(state, device)
        hf._init_weights(head)
    finally:
        head._parameters["weight"] = shared


def hf_ties(cfg: TrainConfig, stages: int) -> list[dict[int, str]]:
    """``fs.tie_across_stages``'s declaration for ``model.hf`` cut into ``stages``: the
    embedding and the head's copy when the config ties them, else none."""
    if stages < 2 or not getattr(_config(cfg.model.hf), "tie_word_embeddings", False):
        return []
    ((head, embedding),) = TIED_HEAD.items()
    return [{0: embedding, stages - 1: head}]


def build_hf_stages(
    cfg: TrainConfig, device: torch.device, indices: list[int], n: int, dp_mesh: Any,
    vocab_needed: int, tp_mesh: Any = None,
) -> list[HFStage]:  # fmt: skip
    """This rank's stages of ``model.hf``, built on meta, made tensor-parallel over
    ``tp_mesh`` if given, sharded over ``dp_mesh``, initialised as the unsplit model (or read
    from the directory's weights)."""
    from transformers import AutoModelForCausalLM

    from flatshard.tools.train import hf_model
    from flatshard.tools.train.pipeline_stage import layer_split
    from flatshard.tools.train.resolve import comm, mixed_precision

    where = hf_model.check_hf_dir(cfg.model.hf)
    config = _config(cfg.model.hf)
    hf_model._check_fits(config, cfg.model.hf, cfg.data.seq_len, vocab_needed)
    torch.manual_seed(cfg.seed)  # as the unsplit path: the same generator before init
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    whole = sum(p.numel() for p in hf.parameters())
    weights = hf_model.has_weights(where)
    states = {} if weights else init_states(hf, device)
    split = layer_split(config.num_hidden_layers, n)
    stages = [HFStage(hf, split[s], first=s == 0, last=s == n - 1) for s in indices]
    if tp_mesh is not None:
        _tensor_parallel(hf, stages, tp_mesh)
    for stage in stages:
        stage.whole_params = whole
        fs.shard(stage, policy=fs.wrap.by_type(type(hf.model.layers[0])),
                 strategy=cfg.parallel.strategy, mixed_precision=mixed_precision(cfg),
                 mesh=dp_mesh, timeout_s=cfg.parallel.timeout_s, comm=comm(cfg),
                 init_fn=_stage_init(hf, stage, states, device))  # fmt: skip
        if weights:  # rank-sliced; the file also holds the other stages' weights
            fs.load(where, model=stage, strict=False)
    return stages


def _tensor_parallel(hf: nn.Module, stages: list[HFStage], tp_mesh: Any) -> None:
    """``parallelize_hf``'s plan on the unsplit meta model, whose modules the stages hold, and
    the head's plan on a tied head's copy (``Shard(0)``, as the embedding: what
    ``fs.tie_across_stages`` needs); see [Note: HF stages under TP]."""
    from flatshard.models.tensor_parallel import parallelize_gpt_head, parallelize_hf

    parallelize_hf(hf, tp_mesh)
    for stage in stages:
        stage.tp_mesh = tp_mesh
        if stage.lm_head is not None and stage.lm_head is not hf.lm_head:
            parallelize_gpt_head(stage.lm_head, tp_mesh)


def flops_per_token(stage: HFStage, attention_length: float) -> float:
    """The whole model's training FLOPs per token, as ``hf_model.flops_per_token``."""
    layers = stage.hf_config.num_hidden_layers
    return 6 * stage.whole_params + 12 * layers * stage.width * attention_length
