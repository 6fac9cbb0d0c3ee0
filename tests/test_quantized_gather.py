"""``fs.Comm(gather="int8"|"fp8"|"bf16")``: parameters all-gathered quantized (ZeRO++'s
qwZ) and dequantized into the compute dtype where they arrive (see [Note: quantized weight
gather] in features/quantized_gather.py). Every rank's values are checked, at world 2 and 3;
the cases are in ``quantized_gather_cases.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import flatshard as fs
from flatshard.core.options import parse_options
from flatshard.tools.train.config import TrainConfig
from flatshard.tools.train.config_io import apply_overrides
from flatshard.tools.train.resolve import comm
from nccl_pool import strict_pools  # noqa: F401 (the fixture)
from quantized_gather_cases import (
    disagree,
    full_state_is_the_masters,
    gathered_full,
    summon_refused,
    train,
)

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))  # fault_common: the tiny config


@pytest.mark.parametrize("world", [2, 3])
def test_full_is_every_ranks_dequantized_shard_and_the_bytes(dist_pools, world):
    cases = [("int8", torch.bfloat16), ("fp8", torch.bfloat16), ("int8", None), ("bf16", None)]
    for fmt, compute in cases:
        for rank, r in enumerate(dist_pools(world).run(gathered_full, fmt, compute)):
            where = (fmt, compute, rank, r)
            assert r["exact"], where  # bit for bit: dequantize(quantize(each rank's chunk))
            assert 0 < r["worst"] <= 1.0, where  # within the bound, and it did round
            # int8/fp8: 1 byte per element + 4 per 256-element block; bf16: 2 per element
            assert r["bytes"] == r["expected"], where


@pytest.mark.parametrize("world", [2, 3])
def test_training_stays_close_and_backward_reads_the_forward_bytes(dist_pools, world):
    pool = dist_pools(world)
    ref = pool.run(train, None)[0]["losses"]
    for rank, r in enumerate(pool.run(train, "int8")):
        assert r["same"], rank  # the regather before backward wrote the same bytes
        assert r["gathers"] > 3, (rank, r["gathers"])  # 3 units, regathered for backward
        # int8 moves each weight by <= absmax/254 of its block (~0.4% of the largest weight,
        # as bf16's own rounding of 2^-9 relative): 4 SGD steps on a loss ~1 differ < 0.5%
        # (measured: 4e-4 at world 2 and 3).
        rel = [abs(a - b) / b for a, b in zip(r["losses"], ref, strict=True)]
        assert 0 < max(rel) < 0.005, (rank, r["losses"], ref)


def _parse(comm, offload=None, mp=None, strategy="full_shard", model=None):
    model = nn.Linear(2, 2) if model is None else model
    return parse_options(model, strategy, mp, offload, None, None, None, False, None, True, comm)


def test_refusals_and_no_effect_warnings():
    with pytest.raises(ValueError, match=r"Comm\(gather='int4'\) is unknown.*'int8', 'fp8'"):
        fs.Comm(gather="int4")
    with pytest.raises(ValueError, match=r"gather='int8'.*CPUOffload.*drop offload="):
        _parse(fs.Comm(gather="int8"), offload=fs.CPUOffload(params=True))
    with pytest.warns(UserWarning, match=r"gather='bf16'\)\) has no effect.*param_dtype"):
        _parse(fs.Comm(gather="bf16"), mp=fs.MixedPrecision(param_dtype=torch.bfloat16))
    with pytest.warns(UserWarning, match=r"gather='int8'\)\) has no effect: no_shard"):
        _parse(fs.Comm(gather="int8"), strategy="no_shard")
    assert "gather='fp8'" in repr(fs.Comm(gather="fp8"))  # in fs.shard's fingerprint


def test_tensor_parallel_parameters_are_refused(patched_attr):
    from flatshard.core import options

    refused = pytest.raises(ValueError, match=r"gather='int8'.*'weight' is tensor-parallel")
    with patched_attr(options, "spec_of", lambda p: object()), refused:  # every one "is" TP
        _parse(fs.Comm(gather="int8"))


def test_disagreeing_ranks_fail_summon_is_refused_exports_are_exact(dist_pools):
    pool = dist_pools(2)
    for rank, message in enumerate(pool.run(disagree)):
        assert "ranks disagree" in message and "gather=" in message, (rank, message)
    for rank, message in enumerate(pool.run(summon_refused)):
        assert "gather='int8'" in message and "full_state_dict" in message, (rank, message)
    assert all(pool.run(full_state_is_the_masters))  # exports read the exact masters


# ---- the trainer ---------------------------------------------------------------------------------
def test_trainer_config_comm_gather():
    cfg = apply_overrides(TrainConfig(), [("comm.gather", "int8")])
    assert comm(cfg) == fs.Comm(gather="int8")
    both = apply_overrides(TrainConfig(), [("comm.gather", "fp8"), ("comm.reduce", "bf16")])
    assert comm(both) == fs.Comm(reduce="bf16", gather="fp8")
    assert comm(TrainConfig()) is None
    with pytest.raises(Exception, match=r"comm.gather.*int4.*none, bf16, fp8, int8"):
        apply_overrides(TrainConfig(), [("comm.gather", "int4")])


@pytest.mark.slow
def test_trainer_runs_with_an_int8_gather(tmp_path):
    from fault_common import TINY_TOML

    (tmp_path / "tiny.toml").write_text(TINY_TOML)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "flatshard.tools.cli", "train", "--config",
           str(tmp_path / "tiny.toml"), "--nproc", "2", "--steps", "3", "--comm.gather", "int8",
           "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows), rows


@pytest.mark.slow  # a strict-semantics pool
def test_nccl_path_runs_clean(strict_pools):  # noqa: F811
    """The device path (``strict_async``: NCCL's semantics, virtual streams): the received
    buffer and the decode at the wait obey [Note: streams and buffer lifetimes]."""
    from stream_cases import assert_clean, run_stream_cases

    jobs = [("train", "quantized_gather_cases", "train", ("int8",))]
    for rank, per_label in enumerate(strict_pools(2).run(run_stream_cases, jobs, timeout=600)):
        for label, r in per_label.items():
            assert_clean(r, rank, label)
            assert r["result"]["same"], (label, rank)
            assert r["collectives"].get("side", 0) > 0, r["collectives"]
