"""Cases of tests/test_float8.py, run on every rank of a Gloo pool (``dist_pool.py``).

A tiny model whose linears torchao converts to ``Float8Linear`` (emulated on the CPU, float8
all-gather on) trains a few SGD steps under ``fs.shard`` and under torch's
``DistributedDataParallel`` from the same init on the same per-rank micro-batches (float8
scales each rank's activations by its own micro-batch, so the reference is per-rank gradients
averaged). Every rank compares its fragments with the same slice of DDP's parameters.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import flatshard as fs
from flatshard.core.state import get_state

STEPS = 3
LR = 0.5


def plain_model(layout: str = "blocks") -> nn.Module:
    """``blocks``: every linear a unit of its own. ``root``: the first and last linears belong
    to the root (split into the lazy root and its tail), the middle one is a unit."""
    torch.manual_seed(0)  # every rank the same weights
    middle = [nn.Linear(48, 48, bias=False), nn.GELU()]
    if layout == "root":
        middle = [nn.Sequential(*middle)]
    return nn.Sequential(
        nn.LayerNorm(32), nn.Linear(32, 48), nn.GELU(), *middle, nn.Linear(48, 16)
    )  # fmt: skip


def float8_model(all_gather: bool = True, layout: str = "blocks") -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=all_gather)
    return convert_to_float8_training(plain_model(layout), config=config)


def shard_float8(mp: str = "fp32", layout: str = "blocks", coalesce: bool = True) -> nn.Module:
    from flatshard.features import root_split

    mixed = fs.MixedPrecision(param_dtype=torch.bfloat16) if mp == "bf16" else None
    policy = fs.wrap.by_type(nn.Linear if layout == "blocks" else nn.Sequential)
    kept = root_split.LAZY_MIN_BYTES
    root_split.LAZY_MIN_BYTES = 0  # the root would be lazy at any size
    try:
        model = float8_model(True, layout)
        return fs.shard(model, policy=policy, mixed_precision=mixed, coalesce=coalesce)
    finally:
        root_split.LAZY_MIN_BYTES = kept


def batch(step: int, rank: int | None = None) -> torch.Tensor:
    """This rank's micro-batch of ``step``: different on every rank."""
    rank = dist.get_rank() if rank is None else rank
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 32, generator=g) * 3.0


def train(
    model: nn.Module, bf16: bool = False, steps: int = STEPS, precompute: bool = False
) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        x = batch(step)
        out = model(x.bfloat16() if bf16 else x)
        out.float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        if precompute:
            fs.precompute_float8_scales(model)


def ddp_reference(steps: int = STEPS, layout: str = "blocks") -> dict[str, torch.Tensor]:
    """DDP over the same float8 model: the full fp32 parameters after ``steps`` steps."""
    model = nn.parallel.DistributedDataParallel(float8_model(True, layout))
    train(model, steps=steps)
    return {n.removeprefix("module."): p.detach().clone() for n, p in model.named_parameters()}


def fragment_errors(model: nn.Module, reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Max |fragment - reference slice| per parameter, on this rank (white-box: the ranges)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for unit in get_state(model).units:
        for group in unit.groups:
            for spec in group.specs:
                start, end = group.fragment_range(spec)
                ref = reference[names[id(spec.fragment)]].reshape(-1)[start:end]
                out[names[id(spec.fragment)]] = (
                    (spec.fragment.detach() - ref).abs().max().item() if end > start else 0.0
                )
    return out


def parity(
    mp: str, precompute: bool = False, layout: str = "blocks", coalesce: bool = True
) -> dict:
    """Every rank: its fragments' errors against DDP after ``STEPS`` steps, and the kinds of
    flat groups (compute dtype, float8?) the model was built with."""
    reference = ddp_reference(layout=layout)
    model = shard_float8(mp, layout, coalesce)
    train(model, bf16=mp == "bf16", precompute=precompute)
    kinds = [
        (str(g.compute_dtype), g.float8 is not None)
        for u in get_state(model).units
        for g in u.groups
    ]
    roles = [u.role.value for u in get_state(model).units if u.float8_groups]
    merged = [u.merged for u in get_state(model).units if u.float8_groups]
    errors = fragment_errors(model, reference)
    return {"errors": errors, "kinds": kinds, "roles": roles, "merged": merged}


def convert_blocks(stage: nn.Module) -> nn.Module:
    """A pipeline stage of ``pipeline_cases`` with its blocks' linears torchao float8 (emulated,
    float8 all-gather on); the embedding and the head stay as they are."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=True)
    return convert_to_float8_training(
        stage, config=config, module_filter_fn=lambda _, fqn: fqn.startswith("blocks")
    )


def pipeline_float8(specs: list[dict]) -> list[dict]:
    """``pipeline_cases``' pp 2 x dp 2 stages with float8 blocks, the schedule called inside
    ``fs.pipeline_step`` (``mode="explicit"``) or plainly (``"plain"``); the reference is one
    process training the same float8 model on the same microbatches (each scales its own
    activations). Per spec this rank's worst fragment error and its float8 flat groups."""
    from pipeline_cases import _FAILED, STEPS, Run, run_each
    from pipeline_plain_cases import fragment_error, one_step

    def run_one(spec: dict) -> dict:
        plain = spec["mode"] == "plain"
        engine = "flatshard_plain" if plain else "flatshard"
        run = Run({**spec, "engine": engine, "optim": "sgd", "float8": True})
        for step in range(STEPS):
            one_step(run, step, plain) if plain else run.step(step)
        err, worst = fragment_error(run)
        groups = [g for m in run.mine for u in get_state(m).units for g in u.float8_groups]
        return {"err": err, "worst": worst, "float8_groups": len(groups)}

    return run_each(specs, run_one, _FAILED)


def linears_only(all_gather: bool) -> nn.Module:
    """Three float8 linears and nothing else: every gathered element is a float8 weight's."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(32, 32, bias=False) for _ in range(3)))
    config = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=all_gather)
    model = convert_to_float8_training(model, config=config)
    return fs.shard(model, policy=fs.wrap.by_type(nn.Linear))


def gather_bytes(all_gather: bool) -> dict:
    """Bytes per gathered element, and amax all-reduces, over one step, then (float8 scales
    precomputed after the step) over the next one, then over a third (that step's
    ``opt.step()`` forgot them: computed again, never stale)."""
    model = linears_only(all_gather)
    shard_numel = {g.shard_numel for u in get_state(model).units for g in u.groups}
    (numel,) = shard_numel  # every unit the same size
    out = {}
    for phase in ("dynamic", "precomputed", "after a step"):
        fs.comm_stats(model, reset=True)
        train(model, steps=1, precompute=phase == "dynamic" and all_gather)
        stats = fs.comm_stats(model)
        per_element = stats.bytes["all_gather"] / (stats.calls["all_gather"] * numel)
        out[phase] = {
            "per_element": per_element,
            "gathers": stats.calls["all_gather"],
            "amax": stats.calls.get("float8_amax", 0),
        }
    return out


def checkpoints(tmp: str) -> dict:
    """After training: the full state dict (rank 0) against DDP's fp32 weights and loaded into
    the unconverted model; ``fs.save``/``fs.load`` into a fresh float8 model, which gathers
    in float8 and matches; an exported safetensors file holds the fp32 weights."""
    reference = ddp_reference()
    model = shard_float8()
    train(model)
    full = fs.full_state_dict(model)
    out: dict = {"full_err": None}
    if dist.get_rank() == 0:
        plain = plain_model()
        plain.load_state_dict(full, strict=True)  # the unconverted model takes it
        out["full_err"] = max((full[k] - v).abs().max().item() for k, v in reference.items())
        out["full_dtypes"] = sorted({str(v.dtype) for v in full.values()})
    try:
        with fs.summon_full_params(model):
            out["summon"] = "entered"
    except NotImplementedError as err:
        out["summon"] = str(err)
    fs.save(f"{tmp}/ckpt", model=model).wait()
    exported = fs.export_safetensors(model, f"{tmp}/model.safetensors")
    if exported is not None:
        from safetensors.torch import load_file

        weights = load_file(str(exported))
        out["export_err"] = max((weights[k] - v).abs().max().item() for k, v in reference.items())
    loaded = shard_float8()
    fs.load(f"{tmp}/ckpt", model=loaded)
    out["load_errors"] = fragment_errors(loaded, reference)
    fs.comm_stats(loaded, reset=True)
    train(loaded, steps=1)
    stats = fs.comm_stats(loaded)
    out["loaded_amax_calls"] = stats.calls.get("float8_amax", 0)
    out["kinds"] = [g.float8 is not None for u in get_state(loaded).units for g in u.groups]
    return out


# ---- float8 with tensor parallelism (torchao's Float8ColwiseParallel / Float8RowwiseParallel) --
class _MLP(nn.Module):
    """A norm (replicated over tp, not float8: one unit mixes float8 TP weights with a plain
    parameter) and two float8 linears."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.up, self.down = nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def _tp_float8_model(tp_mesh) -> nn.Module:
    """Two float8 MLPs made tensor-parallel the torchtitan way (float8 casts before TP's
    collectives); the same weights on every rank."""
    from torch.distributed.tensor.parallel import parallelize_module
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
    )

    torch.manual_seed(0)
    model = nn.Sequential(_MLP(), _MLP())
    config = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config)
    plan = {"up": Float8ColwiseParallel(), "down": Float8RowwiseParallel()}
    for block in model:
        parallelize_module(block, tp_mesh, plan)
    return model


def tp_parity(precompute: bool) -> dict:
    """World 4 = dp 2 x tp 2: ``fs.shard`` over dp of the float8 TP model against the same TP
    model unsharded, its gradients averaged over dp by hand (per-dp-rank micro-batches, the tp
    ranks of a dp group reading the same). Every rank: its fragments against the reference's
    TP-local blocks after ``STEPS`` SGD steps."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_group, dp_rank = mesh["dp"].get_group(), mesh["dp"].get_local_rank()
    reference = _tp_float8_model(mesh["tp"])
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    model = fs.shard(_tp_float8_model(mesh["tp"]), policy=fs.wrap.by_type(_MLP), mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x = batch(step, dp_rank)
        for net, optimizer in ((reference, ref_opt), (model, opt)):
            net(x).square().mean().backward()
            if net is reference:  # DDP by hand over dp: the TP-local gradients averaged
                for p in reference.parameters():
                    dist.all_reduce(_local(p.grad), group=dp_group)
                    _local(p.grad).div_(2)
            optimizer.step()
            optimizer.zero_grad()
        if precompute:
            fs.precompute_float8_scales(model)
    local = {n: _local(p).detach() for n, p in reference.named_parameters()}
    groups = [g for u in get_state(model).units for g in u.float8_groups]
    return {"errors": fragment_errors(model, local), "float8_groups": len(groups)}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's TP-local tensor; a plain (tp-replicated) tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
