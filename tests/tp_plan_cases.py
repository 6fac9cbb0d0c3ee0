"""Tensor-parallel plans against single-process training: the cases behind tests/test_models_tp.py.

Every case builds a model from a seed, keeps a plain copy (the reference, trained in the same
process on the same batch), makes the other tensor-parallel with ``parallelize_gpt`` or
``parallelize_hf`` over a tp mesh, and runs ``STEPS`` SGD steps on both. Per case it returns the
largest relative error (``max|tp - ref| / max|ref|`` per tensor, the max over tensors) of the
losses, of every gradient (gathered with ``full_tensor()``), and of the parameters after the
steps. A spec is a dict: ``model`` ("gpt", "llama", "qwen2"), ``sp``, ``lp`` (loss_parallel,
GPT only), ``config`` overrides, ``packed`` (GPT: a packed batch with cu_seqlens), ``dp``
(independent replicas: the world is a ``(dp, world/dp)`` mesh, each replica its own batch).
"""

from __future__ import annotations

import copy
import traceback

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from flatshard.models import GPT, GPTConfig
from flatshard.models.tensor_parallel import parallelize_gpt, parallelize_hf

STEPS = 2
LR = 0.5
BATCH, SEQ, VOCAB = 2, 8, 64
GPT_BASE = dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=32,
                tie_embeddings=False)  # fmt: skip
HF_BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
               tie_word_embeddings=False)  # fmt: skip


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = _full(got).detach().double(), want.detach().double()
    assert got.shape == want.shape, (got.shape, want.shape)
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _build(spec: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    if spec["model"] == "gpt":
        return GPT(GPTConfig(**{**GPT_BASE, **spec.get("config", {})}))
    import transformers

    family = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    }
    config_cls, model_cls = (getattr(transformers, n) for n in family[spec["model"]])
    config = config_cls(**{**HF_BASE, **spec.get("config", {})}, attn_implementation="sdpa")
    return model_cls(config)


def _batch(spec: dict, step: int, replica: int) -> dict:
    g = torch.Generator().manual_seed(1000 * replica + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels[0, :2] = -100  # ignored targets take part too
    if spec["model"] != "gpt":
        return {"input_ids": ids, "labels": labels}
    batch = {"input_ids": ids, "labels": labels}
    if spec.get("packed"):  # documents of 3, 5 (row 0) and 8 tokens (row 1)
        batch["cu_seqlens"] = torch.tensor([0, 3, 8, 16], dtype=torch.int32)
    return batch


def _loss(model: torch.nn.Module, spec: dict, batch: dict) -> torch.Tensor:
    out = model(**batch)
    return out if spec["model"] == "gpt" else out.loss


def _step(model, opt, spec: dict, batch: dict, parallel_loss: bool) -> torch.Tensor:
    opt.zero_grad()
    if parallel_loss:  # the loss and its backward both need the context
        with loss_parallel():
            loss = _loss(model, spec, batch)
            loss.backward()
    else:
        loss = _loss(model, spec, batch)
        loss.backward()
    return loss.detach()


def _parallelize(model, tp_mesh, spec: dict):
    if spec["model"] == "gpt":
        return parallelize_gpt(
            model, tp_mesh, sequence_parallel=spec["sp"], loss_parallel=spec.get("lp", False)
        )
    return parallelize_hf(model, tp_mesh, sequence_parallel=spec["sp"])


def _placements(model: torch.nn.Module) -> dict[str, str]:
    """Parameter name -> its tp placement ("plain" for a parameter left a plain tensor)."""
    return {
        name: str(p.placements[0]) if isinstance(p, DTensor) else "plain"
        for name, p in model.named_parameters()
    }


def run_parity(spec: dict, tp_mesh, replica: int) -> dict:
    """One case on this rank: the errors of the tp model against its plain copy, and the tp
    model's placements."""
    ref = _build(spec)
    model = _parallelize(copy.deepcopy(ref), tp_mesh, spec)
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (ref, model)]
    errors = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(STEPS):
        batch = _batch(spec, step, replica)
        want = _step(ref, opts[0], spec, batch, parallel_loss=False)
        got = _step(model, opts[1], spec, batch, parallel_loss=spec.get("lp", False))
        errors["loss"] = max(errors["loss"], _rel(got, want))
        pairs = zip(model.named_parameters(), ref.named_parameters(), strict=True)
        for (name, p), (ref_name, r) in pairs:  # strict: a lost tie shows as an extra parameter
            assert name == ref_name, (name, ref_name)
            errors["grad"] = max(errors["grad"], _rel(p.grad, r.grad))
        for o in opts:
            o.step()
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        errors["param"] = max(errors["param"], _rel(p, r))
    return {"errors": errors, "placements": _placements(model)}


def case_parity(specs: dict[str, dict]) -> dict[str, dict | str]:
    """Every spec on this rank's meshes (built once per ``dp``); name -> :func:`run_parity`'s
    result, or the traceback of the spec's failure."""
    world = dist.get_world_size()
    meshes = {}
    results: dict[str, dict] = {}
    for name, spec in specs.items():
        dp = spec.get("dp", 1)
        if dp not in meshes:
            meshes[dp] = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
        mesh = meshes[dp]
        try:  # reported, not raised: the other specs still run (a spec's failure is symmetric)
            results[name] = run_parity(spec, mesh["tp"], replica=mesh.get_local_rank("dp"))
        except Exception:
            results[name] = traceback.format_exc()
    return results


def _refusal(make) -> str:
    """The message of the ValueError/TypeError ``make()`` raises ("" when it raises none)."""
    try:
        make()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def _gpt(**overrides) -> GPT:
    return GPT(GPTConfig(**{**GPT_BASE, **overrides}))


def _hf(model: str, **overrides):
    return _build({"model": model, "config": overrides})


def case_refusals() -> dict[str, str]:
    """Inputs the plans must refuse (at tp = world), each with its message; no collective runs
    before a refusal, so the ranks stay in step."""
    import transformers

    world = dist.get_world_size()
    tp = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    mesh_2d = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=1,
            n_head=4,
            n_positions=32,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    short = torch.zeros(1, SEQ - 1, dtype=torch.long)  # odd: SP cannot split it
    even = torch.zeros(1, SEQ, dtype=torch.long)
    return {
        "n_heads": _refusal(lambda: parallelize_gpt(_gpt(d_model=36, n_heads=3), tp)),
        "n_kv_heads": _refusal(lambda: parallelize_gpt(_gpt(n_kv_heads=1), tp)),
        "d_ff": _refusal(lambda: parallelize_gpt(_gpt(d_ff=51), tp)),
        "vocab_size": _refusal(lambda: parallelize_gpt(_gpt(vocab_size=VOCAB - 1), tp)),
        "mesh_2d": _refusal(lambda: parallelize_gpt(_gpt(), mesh_2d)),
        "twice": _refusal(lambda: parallelize_gpt(parallelize_gpt(_gpt(), tp), tp)),
        "hf_to_gpt": _refusal(lambda: parallelize_gpt(_hf("llama"), tp)),
        "hf_arch": _refusal(lambda: parallelize_hf(gpt2, tp)),
        "hf_kv_heads": _refusal(lambda: parallelize_hf(_hf("qwen2", num_key_value_heads=1), tp)),
        "sp_length": _refusal(lambda: parallelize_gpt(_gpt(), tp)(short)),
        "hf_sp_length": _refusal(lambda: parallelize_hf(_hf("llama"), tp)(short)),
        "lp_no_context": _refusal(
            lambda: parallelize_gpt(_gpt(), tp, loss_parallel=True)(even, labels=even)
        ),
        "hf_sp_embeds": _refusal(
            lambda: parallelize_hf(_hf("llama"), tp)(inputs_embeds=torch.zeros(1, SEQ, 32))
        ),
    }
