"""The rest of the API on tensor-parallel models (issue 27): the cases behind
tests/test_tensor_parallel_optim.py.

World 4. Layouts: ``tp`` = dp 2 x tp 2 (``tp_cases``' model and torchtitan-style plan, with
or without sequence parallelism), ``dp`` = plain dp 4 (no TP); world 8: ``hybrid`` =
hybrid_shard over (replicate 2, shard 2) x tp 2. The reference is one process
training the unsharded model on the global batch of ``BATCH`` sequences (each layout's dp
ranks take equal slices), float64 throughout.

* ``train_case``: ``fs.optim.Muon`` (hidden matrices; SGD for the rest) or
  ``fs.optim.Adafactor`` against ``torch.optim.Muon`` / ``torch.optim.Adafactor``.
* ``reload_case``: ``fs.full_optimizer_state_dict`` after two steps (checked against the
  reference optimizer's state), loaded with the full state dict into a fresh model of another
  (or the same) layout, then one more step.
* ``export_case``: ``fs.export_safetensors`` of a trained TP model against the reference's
  state dict, read back into a fresh TP model with ``fs.load_full_state_dict_from_file``;
  ``pretrained_case``: ``fs.save_pretrained`` of a tensor-parallel HF Llama, read with
  ``from_pretrained``.

Every rank checks its own fragments against the reference (``fragment_err``); the ranks that
hold the full state dict check it as well.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

import flatshard as fs
from flatshard.core.params import fragment_tag
from flatshard.parallel.tensor import local_part
from tp_cases import FFN, SEQ, VOCAB, Block, build, loss_of, mesh_of, parallelize
from tp_cases import rel_err as _rel_err

BATCH = 4  # sequences in the global batch: 2 per dp rank at dp 2, 1 at dp 4
MUON = dict(lr=0.02, weight_decay=0.1)
ADAFACTOR = dict(lr=0.01, weight_decay=0.1)
ADAMW = dict(lr=1e-2, weight_decay=0.1)
SGD_LR = 0.05


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``tp_cases.rel_err``, infinite for a wrong shape (a TP-local block where the global
    tensor belongs): a failed check, not an exception on one rank while the others wait."""
    return _rel_err(got, want) if got.shape == want.shape else float("inf")


def _layout(kind: str) -> tuple:
    """(dp mesh, tp mesh or None, dp size, this rank's dp index) of layout ``kind``."""
    if kind == "tp":
        mesh = mesh_of((2, 2), ("dp", "tp"))
        return mesh["dp"], mesh["tp"], 2, mesh["dp"].get_local_rank()
    if kind == "hybrid":  # world 8: (replicate 2, shard 2, tp 2)
        mesh = mesh_of((2, 2, 2), ("replicate", "shard", "tp"))
        dp = mesh["replicate", "shard"]
        return dp, mesh["tp"], 4, dp.get_local_rank(0) * 2 + dp.get_local_rank(1)
    mesh = mesh_of((4,), ("dp4",))
    return mesh, None, 4, mesh.get_local_rank()


def _model(kind: str, sp: bool, ffn: int = FFN) -> tuple[nn.Module, tuple]:
    """A fresh float64 model (``build``'s initial weights) in layout ``kind``."""
    dp_mesh, tp_mesh, dp_size, dp_index = _layout(kind)
    model = build(ffn=ffn).double()
    if tp_mesh is not None:
        parallelize(model, tp_mesh, sp=sp, loss_par=False)
    strategy = "hybrid_shard" if kind == "hybrid" else "full_shard"
    fs.shard(model, policy=fs.wrap.by_type(Block), mesh=dp_mesh, strategy=strategy)
    return model, (dp_size, dp_index)


def _optimizers(model: nn.Module, name: str, ours: bool) -> list[torch.optim.Optimizer]:
    if name == "muon":  # Muon for the hidden matrices, SGD for the rest (both sides)
        matrices, others = fs.optim.muon_split(model)
        muon = fs.optim.Muon if ours else torch.optim.Muon
        return [muon(matrices, **MUON), torch.optim.SGD(others, lr=SGD_LR)]
    if name == "adafactor":
        adafactor = fs.optim.Adafactor if ours else torch.optim.Adafactor
        return [adafactor(model.parameters(), **ADAFACTOR)]
    return [torch.optim.AdamW(model.parameters(), **ADAMW)]


def _step(model: nn.Module, opts: list, step: int, where: tuple[int, int]) -> None:
    """One step on this rank's slice of the global batch of ``step``."""
    g = torch.Generator().manual_seed(300 + step)
    tokens, target = (torch.randint(VOCAB, (BATCH, SEQ), generator=g) for _ in range(2))
    dp_size, dp_index = where
    rows = slice(dp_index * BATCH // dp_size, (dp_index + 1) * BATCH // dp_size)
    loss_of(model, tokens[rows], target[rows], False)
    for opt in opts:
        opt.step()
        opt.zero_grad()


def fragment_err(model: nn.Module, ref: nn.Module) -> float:
    """The largest error of this rank's fragments against the same elements of ``ref``,
    relative to each parameter's largest element."""
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        tag = fragment_tag(p)
        whole = ref_params[name].detach()
        block = local_part(whole, tag.tp).reshape(-1)[tag.flat_range[0] : tag.flat_range[1]]
        if p.numel():
            err = (p.detach().reshape(-1) - block).abs().max().item()
            worst = max(worst, err / max(whole.abs().max().item(), 1e-12))
    return worst


def state_err(model: nn.Module, ref: nn.Module) -> tuple[float, bool]:
    """(error of ``fs.full_state_dict`` against ``ref``, whether this rank holds it)."""
    state, ref_state = fs.full_state_dict(model), ref.state_dict()
    if not state:
        return 0.0, False
    assert list(state) == list(ref_state), (list(state), list(ref_state))
    return max(rel_err(state[k], ref_state[k]) for k in ref_state), True


def train_case(spec: dict) -> dict:
    """``spec["optim"]`` (muon, adafactor) on ``spec["layout"]`` (default tp), ``steps``
    steps, against torch's."""
    model, where = _model(spec.get("layout", "tp"), spec["sp"], spec.get("ffn", FFN))
    ref = build(ffn=spec.get("ffn", FFN)).double()
    opts, ref_opts = _optimizers(model, spec["optim"], True), _optimizers(ref, spec["optim"], False)
    for step in range(spec.get("steps", 3)):
        _step(model, opts, step, where)
        _step(ref, ref_opts, step, (1, 0))
    err, holds = state_err(model, ref)
    return {"err": max(err, fragment_err(model, ref)), "holds": holds}


def _osd_err(osd: dict, ref: nn.Module, ref_opts: list) -> float:
    """Holders: the full optimizer state against the reference optimizer's (same keys)."""
    by_name = {id(p): n for n, p in ref.named_parameters()}
    worst = 0.0
    for opt in ref_opts:
        for p, values in opt.state.items():
            saved = osd["state"][by_name[id(p)]]
            assert sorted(saved) == sorted(values), (by_name[id(p)], sorted(saved))
            for key, value in values.items():
                if torch.is_tensor(value) and value.dim():
                    worst = max(worst, rel_err(saved[key].to(value.dtype), value))
    return worst


def reload_case(spec: dict) -> dict:
    """Two steps in layout ``spec["save"]``, full model and optimizer state into a fresh
    model in layout ``spec["load"]``, a third step there: against the reference's."""
    name, sp = spec["optim"], True
    model, where = _model(spec["save"], sp)
    ref = build().double()
    opts, ref_opts = _optimizers(model, name, True), _optimizers(ref, name, False)
    for step in range(2):
        _step(model, opts, step, where)
        _step(ref, ref_opts, step, (1, 0))
    osd, sd = fs.full_optimizer_state_dict(model, opts[0]), fs.full_state_dict(model)
    saved_err = _osd_err(osd, ref, ref_opts) if osd else 0.0
    fresh, where = _model(spec["load"], sp)
    fresh_opts = _optimizers(fresh, name, True)
    fs.load_full_state_dict(fresh, sd)
    fs.load_full_optimizer_state_dict(fresh, fresh_opts[0], osd)
    _step(fresh, fresh_opts, 2, where)
    _step(ref, ref_opts, 2, (1, 0))
    err, holds = state_err(fresh, ref)
    return {"err": max(err, fragment_err(fresh, ref)), "saved_err": saved_err, "holds": holds}


def export_case(root: str) -> dict:
    """Export a TP model trained two steps (SGD); rank 0 compares the file with the
    reference; every rank checks a fresh TP model that read the file back."""
    from safetensors.torch import load_file

    model, where = _model("tp", True)
    ref = build().double()
    opts, ref_opts = (
        [torch.optim.SGD(model.parameters(), lr=SGD_LR)],
        [torch.optim.SGD(ref.parameters(), lr=SGD_LR)],
    )
    for step in range(2):
        _step(model, opts, step, where)
        _step(ref, ref_opts, step, (1, 0))
    path = f"{root}/tp.safetensors"
    written = fs.export_safetensors(model, path)
    file_err, keys_match = 0.0, True
    if written is not None:
        saved, ref_state = load_file(path), ref.state_dict()
        keys_match = sorted(saved) == sorted(ref_state)
        file_err = max(rel_err(saved[k], ref_state[k]) for k in ref_state)
    dist.barrier()  # the file is complete before anyone reads it
    fresh, _ = _model("tp", True)
    fs.load_full_state_dict_from_file(path, model=fresh)
    return {
        "written": written is not None,
        "keys_match": keys_match,
        "file_err": file_err,
        "read_back_err": fragment_err(fresh, ref),
    }


def pretrained_case(root: str) -> dict:
    """``fs.save_pretrained`` of an HF Llama made tensor-parallel (dp 2 x tp 2, untrained:
    its random weights tell every element apart); rank 0 loads it with ``from_pretrained``
    and compares with the unsharded model."""
    from flatshard.models.tensor_parallel import parallelize_hf
    from parity_models import CASES, _hf_causal_lm

    case = CASES["hf_llama"]
    torch.manual_seed(0)
    ref = _hf_causal_lm(  # parity_models' Llama, widths that tp 2 divides
        "LlamaConfig",
        "LlamaForCausalLM",
        num_key_value_heads=2,
        intermediate_size=44,
        vocab_size=54,
    )
    model = copy.deepcopy(ref)
    mesh = mesh_of((2, 2), ("dp", "tp"))
    parallelize_hf(model, mesh["tp"], sequence_parallel=True)
    fs.shard(model, policy=case.policy(), mesh=mesh["dp"])
    written = fs.save_pretrained(model, f"{root}/hf", max_shard_size="20KB")
    if written is None:
        return {"written": False}
    loaded = type(ref).from_pretrained(written)
    got, want = loaded.state_dict(), ref.state_dict()
    return {
        "written": True,
        "keys_match": sorted(got) == sorted(want),
        "err": max(rel_err(got[k], want[k]) for k in want),
    }


def run_all(specs: list[dict], root: str) -> list[dict]:
    """Every spec in order (``kind``: train, reload, export, pretrained); a spec that raises
    reports its error and the others still run."""
    cases = {"train": train_case, "reload": reload_case}
    out = []
    for spec in specs:
        try:
            if spec["kind"] == "export":
                out.append(export_case(root))
            elif spec["kind"] == "pretrained":
                out.append(pretrained_case(root))
            else:
                out.append(cases[spec["kind"]](spec))
        except Exception as exc:  # reported, never re-raised: the pool keeps its workers
            out.append({"error": f"{type(exc).__name__}: {exc}"})
        dist.barrier()
    return out
