"""Checkpoints of FSDP x TP models: the cases behind tests/test_tensor_parallel_checkpoint.py.

World 4. A flatshard model at dp 2 x tp 2 (SequenceParallel plan of ``tp_cases``, float64 so
that any misplaced element stands out above rounding) trains 2 SGD-with-momentum steps and is
saved with its optimizer (``fs.save``). It is then loaded into: the same layout; plain 1-D
flatshard at dp 4 (no TP); torch FSDP2 + TP (``dcp.load`` + ``set_state_dict``). Torch FSDP2 +
TP saves a checkpoint the way torchtitan does, and flatshard + TP loads it (``fs.load``).
Each loaded model must hold the saved full state dict exactly and take a third step (which
reads the momentum buffers) to where the saved model's own third step goes.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import flatshard as fs
from tp_cases import Block, build, global_batch, loss_of, mesh_of, parallelize

ROWS = 2


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _model(tp: bool, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build() if seed == 0 else _other_init()
    model = model.to(torch.float64)
    if tp:
        parallelize(model, mesh_of((2, 2), ("dp", "tp"))["tp"], sp=True, loss_par=False)
    return model


def _other_init() -> torch.nn.Module:
    """Other initial values: everything a loaded model holds must come from the file."""
    from tp_cases import Model

    return Model()


def _dp() -> tuple:
    """(dp mesh or group for a TP model, dp size, this rank's dp index) at dp 2 x tp 2."""
    mesh = mesh_of((2, 2), ("dp", "tp"))
    return mesh["dp"], 2, mesh["dp"].get_local_rank()


def _step(model, opt, step: int, dp_size: int, dp_index: int) -> None:
    tokens, target = global_batch(step, 2)  # the same global batch at every layout
    rows = tokens.shape[0] // dp_size
    mine = slice(dp_index * rows, (dp_index + 1) * rows)
    loss_of(model, tokens[mine], target[mine], False)
    opt.step()
    opt.zero_grad()


def _flatshard(tp: bool, seed: int = 0):
    """A sharded model and its optimizer: dp 2 x tp 2, or plain dp 4."""
    model = _model(tp, seed)
    if tp:
        mesh, size, index = _dp()
    else:
        mesh, size, index = None, dist.get_world_size(), dist.get_rank()
    fs.shard(model, policy=fs.wrap.by_type(Block), mesh=mesh)
    return model, _sgd(model), size, index


def _fsdp2(seed: int):
    from torch.distributed.fsdp import fully_shard

    model = _model(True, seed)
    mesh, size, index = _dp()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, _sgd(model), size, index


def _fsdp2_full(model) -> dict:
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def _err(a: dict, b: dict) -> float:
    """Largest absolute difference over the keys of ``b`` (0.0 where ``a`` is empty: this
    rank does not hold both full state dicts)."""
    if not a or not b:
        return 0.0
    return max((a[k] - b[k]).abs().max().item() for k in b)


def saved_flatshard(root: str) -> dict:
    """Train, save, and take the third step; every load case compares with this."""
    model, opt, size, index = _flatshard(True)
    for step in range(2):
        _step(model, opt, step, size, index)
    fs.save(f"{root}/flatshard", model=model, optimizer=opt)
    saved = fs.full_state_dict(model)
    _step(model, opt, 2, size, index)
    return {"saved": saved, "next": fs.full_state_dict(model)}


def load_cases(root: str, expected: dict) -> dict:
    """Per load route: (error of the loaded state, error after the third step), absolute,
    on the ranks that hold a full state dict (0.0 elsewhere)."""
    out = {}
    for tp in (True, False):
        model, opt, size, index = _flatshard(tp, seed=5)
        fs.load(f"{root}/flatshard", model=model, optimizer=opt)
        loaded = fs.full_state_dict(model)
        _step(model, opt, 2, size, index)
        name = "flatshard_tp" if tp else "flatshard_dp4"
        out[name] = (
            _err(loaded, expected["saved"]),
            _err(fs.full_state_dict(model), expected["next"]),
        )
    out["fsdp2_tp"] = _fsdp2_reads_flatshard(f"{root}/flatshard", expected)
    return out


def _fsdp2_reads_flatshard(path: str, expected: dict) -> tuple[float, float]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model, opt, size, index = _fsdp2(seed=5)
    sd = {**get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=path)
    set_optimizer_state_dict(model, opt, sd.pop("optimizer"))
    set_model_state_dict(model, sd)
    loaded = _fsdp2_full(model)
    _step(model, opt, 2, size, index)
    return _err(loaded, expected["saved"]), _err(_fsdp2_full(model), expected["next"])


def fsdp2_saves_flatshard_loads(root: str) -> tuple[float, float]:
    """torchtitan's layout (model keys at the top, ``optimizer.*``) from FSDP2 + TP, read by
    ``fs.load`` into flatshard + TP: (loaded error, error after a third step on both)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    theirs, their_opt, size, index = _fsdp2(seed=0)
    for step in range(2):
        _step(theirs, their_opt, step, size, index)
    msd, osd = get_model_state_dict(theirs), get_optimizer_state_dict(theirs, their_opt)
    dcp.save({**msd, "optimizer": osd}, checkpoint_id=f"{root}/fsdp2")
    saved = _fsdp2_full(theirs)
    _step(theirs, their_opt, 2, size, index)
    after = _fsdp2_full(theirs)
    model, opt, size, index = _flatshard(True, seed=5)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "without checksums": expected for a foreign checkpoint
        fs.load(f"{root}/fsdp2", model=model, optimizer=opt)
    loaded = fs.full_state_dict(model)
    _step(model, opt, 2, size, index)
    return _err(loaded, saved), _err(fs.full_state_dict(model), after)


def tp4_plan(model: torch.nn.Module, tp_mesh) -> None:
    """Another TP layout for (dp 1 x tp 4): embedding, head and MLPs split four ways, the
    attention left whole (2 heads do not split over 4), no sequence parallelism."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    root = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Replicate()),
    }
    parallelize_module(model, tp_mesh, root)
    for block in model.blocks:
        mlp = {"mlp.up": ColwiseParallel(use_local_output=False), "mlp.down": RowwiseParallel()}
        parallelize_module(block, tp_mesh, mlp)


def load_into_tp4(root: str, expected: dict) -> tuple[float, float]:
    """The dp 2 x tp 2 checkpoint into dp 1 x tp 4 with another plan: every TP block is cut
    differently (and the attention is not split at all); the loaded state and the next step
    (the whole global batch on the one dp rank) must be the saved model's."""
    mesh = mesh_of((1, 4), ("dp", "tp"))
    torch.manual_seed(5)
    model = _other_init().to(torch.float64)
    tp4_plan(model, mesh["tp"])
    fs.shard(model, policy=fs.wrap.by_type(Block), mesh=mesh["dp"])
    opt = _sgd(model)
    fs.load(f"{root}/flatshard", model=model, optimizer=opt)
    loaded = fs.full_state_dict(model)
    _step(model, opt, 2, 1, 0)
    return _err(loaded, expected["saved"]), _err(fs.full_state_dict(model), expected["next"])


def safetensors_into_tp(root: str, expected: dict) -> tuple[float, float]:
    """Weights alone: the saved full state as one safetensors file (what ``save_pretrained``
    writes), read by ``fs.load`` into a dp 2 x tp 2 model, each rank its TP block's slices
    (no optimizer state: the second figure is the loaded error again)."""
    from safetensors.torch import save_file

    path = f"{root}/weights.safetensors"
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in expected["saved"].items()}, path)
    dist.barrier()
    model, *_ = _flatshard(True, seed=6)
    fs.load(path, model=model)
    err = _err(fs.full_state_dict(model), expected["saved"])
    return err, err


def fragment_info_of_tp() -> dict:
    """``fs.fragment_info`` of a dp 2 x tp 2 model: each parameter's global shape (the plain
    model's) and its TP block's origin, which must fit inside."""
    model, *_ = _flatshard(tp=True)
    plain = dict(_model(False).named_parameters())
    problems, shifted = [], False
    for name, info in fs.fragment_info(model).items():
        if (
            info.global_shape != plain[name].shape
            or fs.full_shape(info.fragment) != plain[name].shape
        ):
            problems.append(f"{name}: global {info.global_shape}, plain {plain[name].shape}")
        ends = zip(info.origin, info.full_shape, info.global_shape, strict=True)
        if any(o + size > whole for o, size, whole in ends):
            problems.append(f"{name}: block {info.full_shape} at {info.origin} overflows")
        shifted = shifted or any(info.origin)
    return {"problems": problems, "shifted": shifted}


def run_all(root: str) -> dict:
    expected = saved_flatshard(root)
    out = load_cases(root, copy.deepcopy(expected))
    out["fsdp2_to_flatshard_tp"] = fsdp2_saves_flatshard_loads(root)
    out["safetensors_tp"] = safetensors_into_tp(root, expected)
    out["flatshard_dp1_tp4"] = load_into_tp4(root, expected)
    out["fragment_info"] = fragment_info_of_tp()
    return out
