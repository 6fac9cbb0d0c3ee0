"""Tensor-parallel plans for flatshard's GPT and Hugging Face Llama / Qwen2, built from torch's
parallel styles (``parallelize_module``; Megatron's layout as torchtitan's llama3 applies it).

Use them before data-parallel sharding, on the ``tp`` axis of a mesh::

    mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = parallelize_gpt(GPT(config), mesh["tp"], loss_parallel=True)
    model = fs.shard(model, policy=fs.wrap.by_type(Block), mesh=mesh["dp"])
    with torch.distributed.tensor.parallel.loss_parallel():  # only with loss_parallel=True
        loss = model(ids, labels=labels)  # a replicated DTensor; ids/labels equal on a tp group
        loss.backward()

[Note: the layout]
Per block, with sequence parallelism (SP): the residual stream is split on the sequence dim
(``Shard(1)``, each rank holds ``T/tp`` tokens), so the norms (``SequenceParallel``) normalise
only their own tokens. ``PrepareModuleInput`` all-gathers the norm's output at the attention and
MLP inputs (``Replicate``); q/k/v and the MLP's up/gate are colwise (this rank's heads, this
rank's ffn slice); ``o_proj``/``down_proj`` are rowwise, their partial sums reduce-scattered back
to ``Shard(1)``. Without SP the stream is replicated and the rowwise outputs all-reduced; the
``PrepareModuleInput`` then only makes the backward sum q/k/v's (up/gate's) input gradients into
one all-reduce instead of one each. Token embedding rowwise (vocabulary rows), head colwise
(vocabulary columns, gathered unless ``loss_parallel``).

[Note: local heads]
DTensor has no sharding rule for the CPU flash-attention kernel, and attention needs none: q/k/v
leave their projections as local tensors holding this rank's heads (``use_local_output=True``),
and the attention sizes its views from them (``view(B, T, -1, D)``), not from ``n_heads``. Local
tensors carry no padding, so every sharded size must divide by the tp degree (checked here).

[Note: RoPE and positions under SP]
The token ids are replicated, so positions and the RoPE tables are computed from the whole
sequence and enter each attention as plain tensors (layout ``None``: untouched). The attention
runs on the gathered sequence, so they line up with q/k although the stream between sublayers is
split. Hugging Face models derive positions and the causal mask from ``inputs_embeds.shape[1]``:
there the embedding's output stays a ``Shard(1)`` DTensor, whose shape is the global one, and so
does the whole residual stream (``use_local_output=False``).

[Note: tied embeddings]
The embedding (rowwise) and the head (colwise) both split the ``[vocab, d_model]`` weight on dim
0, so one ``Shard(0)`` DTensor serves both: after distributing, the head takes the embedding's
parameter again and the tie survives. A pipeline whose last stage holds its own copy of the
head (``parallelize_gpt_head``) gets the same ``Shard(0)`` there, which is what
``fs.tie_across_stages`` needs to sum the two copies per tp rank ([Note: tensor-parallel tied
copies] in parallel/pipeline_tied.py).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from flatshard.models.float8_tp import float8_styles, has_float8_linears
from flatshard.models.gpt import GPT

__all__ = [
    "HF_ARCHITECTURES",
    "HF_SPLIT_SIZES",
    "parallelize_gpt",
    "parallelize_gpt_head",
    "parallelize_hf",
]

HF_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
"""The Hugging Face classes :func:`parallelize_hf` has a plan for."""
HF_SPLIT_SIZES = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")
"""The config sizes :func:`parallelize_hf` splits over tp: each must divide by the tp degree."""


@dataclass(frozen=True)
class _BlockLayout:
    """Where a block's pieces are (module paths relative to the block) and how they are called."""

    norms: tuple[str, ...]
    attn: str
    attn_input: int | str  # positional arity (activation first) or the activation's kwarg name
    mlp: str
    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]


def parallelize_gpt(
    model: GPT,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
) -> GPT:
    """Make flatshard's :class:`GPT` tensor-parallel over the 1-D ``tp_mesh``, in place.

    Parameters become DTensors (see [Note: the layout]). Every rank of ``tp_mesh`` must feed the
    same ``input_ids``; with ``sequence_parallel`` their length must divide by the tp degree.
    With ``loss_parallel`` the logits stay split on the vocabulary (a ``Shard(-1)`` DTensor) and
    the loss must be computed, forward and backward, inside torch's ``loss_parallel()`` context.
    Returns ``model``.
    """
    tp = _check_gpt(model, tp_mesh, sequence_parallel)
    c, sp = model.config, sequence_parallel
    root_plan: dict[str, ParallelStyle] = {
        "tok_emb": _embedding_style(sp, local_output=True),
        "lm_head": _head_style(sp, loss_parallel),
    }
    if sp:
        root_plan["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, root_plan)
    mlp_colwise = ("mlp.up_proj",) if c.mlp == "gelu" else ("mlp.gate_proj", "mlp.up_proj")
    layout = _BlockLayout(
        norms=("attn_norm", "mlp_norm"),
        attn="attn",
        attn_input=5,  # Block calls attn(x, cos, sin, cu_seqlens, max_seqlen)
        mlp="mlp",
        colwise=("attn.q_proj", "attn.k_proj", "attn.v_proj", *mlp_colwise),
        rowwise=("attn.o_proj", "mlp.down_proj"),
    )
    for block in model.layers:
        # The stream stays local between sublayers (torchtitan's choice): the residual adds and
        # dropout then run on plain tensors.
        float8 = tp_mesh if has_float8_linears(block) else None  # a pipeline converts its own
        plan = _block_plan(layout, sp, local_stream=True, float8=float8)
        parallelize_module(block, tp_mesh, plan)
    if c.tie_embeddings:
        _retie(model.tok_emb, model.lm_head)
    if sp:
        model.register_forward_pre_hook(_sequence_check(tp, "GPT"), with_kwargs=True)
    return model


def parallelize_gpt_head(
    head: nn.Linear,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
) -> nn.Linear:
    """Make a copy of the GPT's output head tensor-parallel as :func:`parallelize_gpt` makes
    the head (vocabulary columns split: a ``Shard(0)`` weight, the embedding's layout), in
    place; for a pipeline's last stage, which holds its own copy of a tied head. Returns
    ``head``."""
    if not isinstance(head, nn.Linear):
        raise TypeError(
            f"parallelize_gpt_head(head=...) takes the GPT's output head, an nn.Linear; got "
            f"{type(head).__name__}: pass the stage's lm_head"
        )
    _check_not_parallel(head)
    _check_divisible(_tp_degree(tp_mesh), {"out_features": head.out_features}, "head")
    parallelize_module(head, tp_mesh, _head_style(sequence_parallel, loss_parallel))
    return head


def parallelize_hf(
    model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = True
) -> nn.Module:
    """Make a Hugging Face ``LlamaForCausalLM`` or ``Qwen2ForCausalLM`` tensor-parallel, in place.

    The projections follow transformers' own ``base_model_tp_plan`` for these models (q/k/v,
    gate/up colwise; o/down rowwise); the embedding is rowwise, ``lm_head`` colwise with its
    logits gathered (the model's loss runs as usual), and with ``sequence_parallel`` the norms
    are ``SequenceParallel`` (see [Note: RoPE and positions under SP]). Every rank of ``tp_mesh``
    must feed the same ``input_ids`` (``inputs_embeds`` are refused under SP); with
    ``sequence_parallel`` their length must divide by the tp degree. Returns ``model``.
    """
    _check_hf_architecture(model)
    _check_not_parallel(model)
    tp = _tp_degree(tp_mesh)
    cfg = model.config
    sizes = {n: getattr(cfg, n) for n in HF_SPLIT_SIZES}
    _check_divisible(tp, sizes, f"{type(model).__name__}'s config")
    sp = sequence_parallel
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    root_plan: dict[str, ParallelStyle] = {
        "model.embed_tokens": _embedding_style(sp, local_output=not sp),
        "lm_head": _head_style(sp, loss_parallel=False),
    }
    if sp:
        root_plan["model.norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, root_plan)
    layout = _BlockLayout(
        norms=("input_layernorm", "post_attention_layernorm"),
        attn="self_attn",
        attn_input="hidden_states",  # the decoder layer calls self_attn with keywords only
        mlp="mlp",
        colwise=(
            *("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            *("mlp.gate_proj", "mlp.up_proj"),
        ),
        rowwise=("self_attn.o_proj", "mlp.down_proj"),
    )
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, _block_plan(layout, sp, local_stream=not sp))
    if tied:
        _retie(model.model.embed_tokens, model.lm_head)
    if sp:
        model.register_forward_pre_hook(_sequence_check(tp, type(model).__name__), with_kwargs=True)
    return model


def _block_plan(
    layout: _BlockLayout, sp: bool, *, local_stream: bool, float8: DeviceMesh | None = None
) -> dict[str, ParallelStyle]:
    """One block's plan; ``local_stream``: rowwise outputs leave as local tensors, not DTensors;
    ``float8``: the tp mesh when the projections are torchao ``Float8Linear``s (models/
    float8_tp.py)."""
    styles = float8_styles(float8) if float8 is not None else (ColwiseParallel, RowwiseParallel)
    colwise, rowwise = styles
    stream = Shard(1) if sp else Replicate()  # the residual stream's layout between sublayers
    plan: dict[str, ParallelStyle] = {}
    if sp:
        plan.update({norm: SequenceParallel() for norm in layout.norms})
    plan[layout.attn] = _gather_input(stream, layout.attn_input)
    plan[layout.mlp] = _gather_input(stream, 1)
    plan.update({name: colwise() for name in layout.colwise})
    plan.update(
        {
            name: rowwise(output_layouts=stream, use_local_output=local_stream)
            for name in layout.rowwise
        }
    )
    return plan


def _gather_input(stream: Shard | Replicate, activation: int | str) -> PrepareModuleInput:
    """Replicate a sublayer's activation input; its other inputs (RoPE, masks) pass untouched."""
    if isinstance(activation, str):
        return PrepareModuleInput(
            input_kwarg_layouts={activation: stream},
            desired_input_kwarg_layouts={activation: Replicate()},
        )
    untouched = (None,) * (activation - 1)
    return PrepareModuleInput(
        input_layouts=(stream, *untouched), desired_input_layouts=(Replicate(), *untouched)
    )


def _embedding_style(sp: bool, *, local_output: bool) -> RowwiseParallel:
    """Vocabulary rows split; the looked-up rows are summed into the stream's layout."""
    return RowwiseParallel(
        input_layouts=Replicate(),
        output_layouts=Shard(1) if sp else Replicate(),
        use_local_output=local_output,
    )


def _head_style(sp: bool, loss_parallel: bool) -> ColwiseParallel:
    """Vocabulary columns split; the logits gathered, or left split for a loss-parallel loss."""
    return ColwiseParallel(
        input_layouts=Shard(1) if sp else Replicate(),
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )


def _retie(embedding: nn.Module, head: nn.Module) -> None:
    """Give ``head`` the embedding's DTensor weight (see [Note: tied embeddings])."""
    weight = embedding.weight
    assert weight.placements == head.weight.placements == (Shard(0),), "tie layouts differ"
    head.weight = weight


def _check_gpt(model: GPT, tp_mesh: DeviceMesh, sp: bool) -> int:
    """Refuse what the GPT plan cannot split; the tp degree."""
    if not isinstance(model, GPT):
        raise TypeError(
            f"parallelize_gpt takes a flatshard GPT, got {type(model).__name__}; for Hugging Face "
            "models use parallelize_hf"
        )
    _check_not_parallel(model)
    tp = _tp_degree(tp_mesh)
    c = model.config
    sizes = {"n_heads": c.n_heads, "n_kv_heads": c.kv_heads, "d_ff": c.ffn_dim}
    _check_divisible(tp, {**sizes, "vocab_size": c.vocab_size}, "GPTConfig")
    if c.dropout > 0 and not sp:
        # The stream is replicated: each tp rank must draw the same mask from its own generator.
        warnings.warn(
            f"GPTConfig.dropout={c.dropout} with sequence_parallel=False: the tp ranks drop the "
            "same activations only if their torch RNG states are equal; seed them alike (or "
            "use sequence_parallel=True, where each rank drops its own tokens)",
            stacklevel=3,
        )
    return tp


def _check_not_parallel(model: nn.Module) -> None:
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError(
            f"{type(model).__name__} already has DTensor parameters (tensor-parallel or "
            "distributed already); apply a tensor-parallel plan once, to a plain model"
        )


def _tp_degree(tp_mesh: DeviceMesh) -> int:
    if not isinstance(tp_mesh, DeviceMesh):
        raise TypeError(f"tp_mesh must be a DeviceMesh, got {type(tp_mesh).__name__}")
    if tp_mesh.ndim != 1:
        raise ValueError(
            f"tp_mesh has {tp_mesh.ndim} dimensions {tp_mesh.mesh_dim_names}; pass the 1-D "
            'tensor-parallel axis, e.g. mesh["tp"]'
        )
    return tp_mesh.size()


def _check_divisible(tp: int, sizes: dict[str, int], owner: str) -> None:
    """Every size the plan splits must divide evenly (see [Note: local heads])."""
    for name, size in sizes.items():
        if size % tp:
            raise ValueError(
                f"{owner}.{name}={size} is not divisible by the tensor-parallel degree {tp} "
                f"(the size of tp_mesh); choose a tp degree that divides {size}, or a model "
                f"whose {name} is a multiple of {tp}"
            )


def _check_hf_architecture(model: nn.Module) -> None:
    # Imported here: `import flatshard` must never import transformers.
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    if not isinstance(model, (LlamaForCausalLM, Qwen2ForCausalLM)):
        raise ValueError(
            f"parallelize_hf has no plan for {type(model).__name__}; supported: "
            f"{', '.join(HF_ARCHITECTURES)}. For another architecture, write a plan with "
            "torch.distributed.tensor.parallel.parallelize_module (flatshard's GPT: "
            "parallelize_gpt)"
        )


def _sequence_check(tp: int, owner: str):
    """A forward pre-hook refusing inputs that sequence parallelism cannot split evenly."""

    def check(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError(
                f"{owner} with sequence_parallel=True needs input_ids, not inputs_embeds (the "
                "embedding makes the sequence split); pass input_ids or sequence_parallel=False"
            )
        ids = args[0] if args else kwargs.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.shape[-1] % tp:
            raise ValueError(
                f"{owner} with sequence_parallel=True splits the sequence over {tp} ranks, but "
                f"input_ids has length {ids.shape[-1]}; pad it to a multiple of {tp} or use "
                "sequence_parallel=False"
            )

    return check
