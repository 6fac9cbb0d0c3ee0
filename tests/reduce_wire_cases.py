"""Cases of tests/test_reduce_wire.py, run on every rank of a pool (Gloo: ``dist_pool.py``;
NCCL's semantics with virtual streams: ``nccl_pool.py`` + ``stream_cases.run_stream_cases``).

One tiny model, one step under bf16 compute with an fp32 ``reduce_dtype``: the fragments'
gradients with ``fs.Comm(reduce="bf16")`` against the fp32 reduce-scatter's (and the bf16
one's, to show the gap the tolerance leaves), and the bytes ``fs.comm_stats`` counted.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import flatshard as fs
from parity_models import mesh_for

WIRES = {"fp32": (torch.float32, None), "bf16 wire": (torch.float32, "bf16"),
         "bf16": (torch.bfloat16, None)}  # fmt: skip


def tiny_model() -> nn.Module:
    torch.manual_seed(0)  # every rank the same weights
    return nn.Sequential(
        nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 40), nn.GELU(), nn.Linear(40, 8)
    )


def shard_tiny(setting: str, strategy: str = "full_shard") -> nn.Module:
    reduce_dtype, wire = WIRES[setting]
    mp = fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    return fs.shard(
        tiny_model(),
        policy=fs.wrap.by_type(nn.Linear),
        mixed_precision=mp,
        strategy=strategy,
        mesh=mesh_for(strategy),
        comm=fs.Comm(reduce=wire),
    )


def _batch(micro: int) -> torch.Tensor:
    """This rank's micro-batch ``micro``: different on every rank."""
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + micro)
    return torch.randn(6, 24, generator=g)


def _backward(model: nn.Module, micro: int) -> None:
    out = model(_batch(micro).bfloat16())
    (out.float().square().mean() * 100.0).backward()  # * 100: gradients well above bf16's ulp


def sharded_grads(setting: str, strategy: str = "full_shard", accumulate: str = "") -> dict:
    """One step's sharded gradients (fp32 fragments, concatenated) and the bytes sent.
    ``accumulate``: "" (one backward) or a ``no_sync`` keep mode (two micro-batches)."""
    model = shard_tiny(setting, strategy)
    fs.comm_stats(model, reset=True)
    if accumulate:
        with fs.no_sync(model, keep=accumulate):
            _backward(model, 0)
    _backward(model, 1)
    grads = [p.grad.reshape(-1) for p in model.parameters() if p.grad is not None and p.numel()]
    return {"grad": torch.cat(grads).clone(), "bytes": fs.comm_stats(model).bytes}


def parity(strategy: str = "full_shard", accumulate: str = "") -> dict:
    """Largest difference of the bf16 wire's and the bf16 reduce-scatter's sharded gradients
    from the fp32 reduce-scatter's, relative to its largest element; and the bytes."""
    runs = {s: sharded_grads(s, strategy, accumulate) for s in WIRES}
    ref = runs["fp32"]["grad"]
    assert ref.numel() and ref.abs().max() > 0, "no gradient on this rank"
    scale = ref.abs().max().item()

    def err(s: str) -> float:
        return (runs[s]["grad"] - ref).abs().max().item() / scale

    return {
        "wire_err": err("bf16 wire"),
        "bf16_err": err("bf16"),
        "bytes": {s: dict(r["bytes"]) for s, r in runs.items()},
    }


def disagree() -> str:
    """Rank 0 asks for the bf16 wire, the others do not: ``fs.shard`` must refuse."""
    setting = "bf16 wire" if dist.get_rank() == 0 else "fp32"
    try:
        shard_tiny(setting)
    except ValueError as err:
        return str(err)
    return ""
