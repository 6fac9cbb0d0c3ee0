"""Mixed precision: low-precision compute/communication with fp32 master shards."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import flatshard as fs
from parity_models import CASES, Block, TinyGPT, mesh_for, rel_err

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, None: None}


def case_loss_curve(name: str, param: str, reduce: str | None, strategy: str) -> dict:
    """Train 6 AdamW steps with mixed precision next to an fp32 single-process reference."""
    case = CASES[name]
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    ref = case.build()
    mp = fs.MixedPrecision(
        param_dtype=DTYPES[param], reduce_dtype=DTYPES[reduce], output_dtype=torch.float32
    )
    model = fs.shard(
        copy.deepcopy(ref),
        policy=case.policy(),
        mixed_precision=mp,
        strategy=strategy,
        mesh=mesh_for(strategy),
    )
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (model, ref))
    worst = 0.0
    for step in range(6):
        batch = case.batch(torch.Generator().manual_seed(step), 2 * world)
        fs.comm_stats(model, reset=True)
        loss = case.loss(model, batch.chunk(world)[rank])
        loss.backward()
        ref_loss = case.loss(ref, batch)
        ref_loss.backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        worst = max(worst, rel_err(mean / world, ref_loss.detach()))
    sent = fs.comm_stats(model).bytes
    return {
        "loss_rel": worst,
        "gather_bytes": sent.get("all_gather", 0),
        "reduce_bytes": sent.get("reduce_scatter", 0) + sent.get("all_reduce", 0),
        "master_fp32": all(p.dtype == torch.float32 for p in model.parameters()),
        "grads_none": all(p.grad is None for p in model.parameters()),
    }


CURVES = [
    ("gpt_tied", "bf16", "fp32", "full_shard"),
    ("hf_llama", "bf16", "fp32", "full_shard"),
    ("gpt_tied", "fp32", "bf16", "full_shard"),
    ("gpt_tied", "bf16", None, "no_shard"),
    ("lora", "bf16", "fp32", "shard_grad_op"),
]


@pytest.mark.parametrize("name, param, reduce, strategy", CURVES)
def test_mixed_precision_loss_curve_within_2_percent_of_fp32(
    dist_pools, name, param, reduce, strategy
):
    r = dist_pools(2).run(case_loss_curve, name, param, reduce, strategy)[0]
    assert r["loss_rel"] <= 0.02, r
    assert r["master_fp32"] and r["grads_none"]


def test_bf16_halves_the_bytes_on_the_wire(dist_pools):
    pool = dist_pools(2)
    fp32 = pool.run(case_loss_curve, "gpt_tied", "fp32", None, "full_shard")[0]
    bf16 = pool.run(case_loss_curve, "gpt_tied", "bf16", None, "full_shard")[0]
    # Half the bytes, up to the padding: chunks are padded to whole 16 bytes, i.e. to 8 bf16
    # elements per rank rather than 4 fp32 ones (a few dozen bytes per unit here).
    assert bf16["gather_bytes"] * 2 == pytest.approx(fp32["gather_bytes"], rel=0.02)
    assert bf16["reduce_bytes"] * 2 == pytest.approx(fp32["reduce_bytes"], rel=0.02)
    assert fp32["loss_rel"] <= 1e-5  # the same harness in fp32 is exact


def case_fp16_reduce(world_scale: float) -> dict:
    """fp16 gradients that would overflow a plain fp16 sum across ranks stay finite and right."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    model = fs.shard(
        copy.deepcopy(ref),
        policy=fs.wrap.by_type(nn.Linear),
        mixed_precision=fs.MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float16),
    )
    world, rank = dist.get_world_size(), dist.get_rank()
    x = torch.randn(2 * world, 8, generator=torch.Generator().manual_seed(1))
    (model(x.chunk(world)[rank]).sum() * world_scale).backward()
    (ref(x).sum() * world_scale / world).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    finite = all(g.isfinite().all() for g in grads)
    torch.optim.SGD(model.parameters(), lr=1e-6).step()
    torch.optim.SGD(ref.parameters(), lr=1e-6).step()
    full = fs.full_state_dict(model)
    err = max(rel_err(full[k], v) for k, v in ref.state_dict().items()) if full else 0.0
    return {"finite": finite, "err": err}


def test_fp16_reduction_divides_before_and_after_the_sum(dist_pools):
    # Each rank's gradient is ~2e4: a plain fp16 sum of 3 ranks (6e4+) is near fp16's 65504.
    for r in dist_pools(3).run(case_fp16_reduce, 2e4):
        assert r["finite"] and r["err"] <= 1e-3


class Scaled(nn.Module):
    """A float buffer and an integer buffer next to parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(6))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * self.scale.to(x.dtype)


def case_buffers_and_io() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), Scaled(), nn.Linear(6, 2))
    seen = {}
    model[0].register_forward_pre_hook(lambda m, a: seen.update(input=a[0].dtype))
    mp = fs.MixedPrecision(
        param_dtype=torch.bfloat16, buffer_dtype=torch.float64, output_dtype=torch.float32
    )
    fs.shard(model, policy=fs.wrap.root_only(), mixed_precision=mp)
    out = model(torch.randn(3, 4))
    return {
        "input": str(seen["input"]),
        "output": str(out.dtype),
        "float_buffer": str(model[1].scale.dtype),
        "int_buffer": str(model[1].calls.dtype),
    }


def test_buffers_inputs_and_outputs_are_cast(dist_pools):
    r = dist_pools(2).run(case_buffers_and_io)[0]
    assert r == {
        "input": "torch.bfloat16",
        "output": "torch.float32",
        "float_buffer": "torch.float64",
        "int_buffer": "torch.int64",
    }


def test_mixed_precision_config_is_validated():
    with pytest.raises(ValueError, match=r"param_dtype=torch\.int32"):
        fs.MixedPrecision(param_dtype=torch.int32)
    with pytest.raises(ValueError, match="reduce_dtype='bf16'"):
        fs.MixedPrecision(reduce_dtype="bf16")


def case_bad_mp_type() -> str:
    try:
        fs.shard(TinyGPT(), policy=fs.wrap.by_type(Block), mixed_precision="bf16")
    except TypeError as err:
        return str(err)
    return ""


def test_mixed_precision_argument_type(dist_pools):
    assert "fs.MixedPrecision" in dist_pools(2).run(case_bad_mp_type)[0]


def case_offload_parity(name: str, mp: bool) -> dict:
    """CPU offload in fp32 (and with bf16 compute) trains exactly like no offload."""
    case = CASES[name]
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    plain = fs.shard(case.build(), policy=case.policy())
    torch.manual_seed(0)
    precision = fs.MixedPrecision(param_dtype=torch.bfloat16) if mp else None
    offloaded = fs.shard(
        case.build(), policy=case.policy(), offload=fs.CPUOffload(), mixed_precision=precision
    )
    if mp:  # compare against the same mixed precision without offload
        torch.manual_seed(0)
        plain = fs.shard(case.build(), policy=case.policy(), mixed_precision=precision)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, offloaded)]
    fs.comm_stats(offloaded, reset=True)
    for step in range(4):
        batch = case.batch(torch.Generator().manual_seed(step), 2 * world).chunk(world)[rank]
        for model, opt in zip((plain, offloaded), opts, strict=True):
            case.loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
    a, b = fs.full_state_dict(plain), fs.full_state_dict(offloaded)
    err = max(rel_err(b[k], v) for k, v in a.items()) if a else 0.0
    calls = fs.comm_stats(offloaded).calls
    return {
        "err": err,
        "on_cpu": all(p.device.type == "cpu" for p in offloaded.parameters()),
        "h2d": calls.get("offload_h2d", 0),
        "d2h": calls.get("offload_d2h", 0),
    }


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name, mp", [("gpt_tied", False), ("lora", False), ("gpt_tied", True)])
def test_cpu_offload_trains_exactly_like_no_offload(dist_pools, world, name, mp):
    for r in dist_pools(world).run(case_offload_parity, name, mp):
        assert r["err"] == 0.0 and r["on_cpu"]
        assert r["h2d"] > 0 and r["d2h"] > 0  # the offload path ran (copies are no-ops on CPU)


def case_exports_write_the_fp32_masters(tmp: str) -> dict:
    """Under bf16 compute, full_state_dict / export_safetensors must hold the fp32 shards'
    values (core/masters.py), not the bf16 copy the forward gathers."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = TinyGPT()
    fs.shard(model, policy=fs.wrap.by_type(Block), mixed_precision=fs.MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32))  # fmt: skip
    with torch.no_grad():  # values no bf16 can hold
        for p in model.parameters():
            p.add_(1e-4 * torch.arange(p.numel(), dtype=p.dtype) / max(p.numel(), 1))
    full = fs.full_state_dict(model)
    fs.export_safetensors(model, f"{tmp}/m.safetensors")
    box = [(full, load_file(f"{tmp}/m.safetensors") if dist.get_rank() == 0 else None)]
    dist.broadcast_object_list(box, src=0)
    full, exported = box[0]
    worst, dtypes = 0.0, set()
    for info in fs.fragment_info(model).values():
        start, end = info.flat_range
        for source in (full, exported):
            got = source[info.name].reshape(-1)[start:end]
            dtypes.add(str(got.dtype))
            if end > start:
                worst = max(worst, (got - info.fragment.detach()).abs().max().item())
    return {"worst": worst, "dtypes": sorted(dtypes)}


def test_exports_write_the_fp32_masters_under_mixed_precision(dist_pools, tmp_path):
    for r in dist_pools(2).run(case_exports_write_the_fp32_masters, str(tmp_path)):
        assert r["dtypes"] == ["torch.float32"]
        assert r["worst"] == 0.0
