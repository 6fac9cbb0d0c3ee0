"""``fs.Comm(reduce="int8"|"fp8", error_feedback=...)``: blockwise-quantized gradients in an
all-to-all, dequantized and summed in fp32 where they arrive, with the quantization residual
fed back into the next step (``comm/quantize.py``, ``core/reduce.py`` ``reduce_quantized``,
``features/error_feedback.py``). Every rank's values are checked, at world 2 and 3; the cases
are in ``quantized_grads_cases.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import flatshard as fs
from flatshard.comm import quantize
from flatshard.core.options import parse_options
from nccl_pool import strict_pools  # noqa: F401 (the fixture)

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))  # fault_common: the tiny config
from quantized_grads_cases import (
    collective_sum,
    disagree,
    feedback_tracks,
    resume_run,
    save_run,
    step_parity,
)

FORMATS = ["int8", "fp8"]
SUM_ORDER = 1e-6  # fp32 sums of the same dequantized addends in another order (vs fp64)


# ---- quantize / dequantize (no process group) ----------------------------------------------------
@pytest.mark.parametrize("row", [256, 300, 5])  # whole blocks, a ragged last block, one short
def test_round_trip_error_bounds(row):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, row, generator=g) * torch.logspace(-6, 2, row)
    x[1, :7] = 0.0  # an all-zero start and a zero block must not divide by zero
    x[2] = 0.0
    for fmt in FORMATS:
        codes, scales = quantize.quantize(x, fmt)
        assert codes.dtype == quantize.FORMATS[fmt][0] and codes.shape == x.shape
        assert scales.shape == (3, quantize.blocks_per_row(row)) and scales.dtype == torch.float32
        back = quantize.dequantize(codes, scales)
        per_elem = scales.repeat_interleave(quantize.BLOCK, dim=1)[:, :row]
        if fmt == "int8":  # half a code step: absmax / 254
            bound = per_elem * 0.5 * 1.0001
        else:  # e4m3: 3 mantissa bits (2^-4 relative), subnormal step 2^-9 (half: 2^-10)
            bound = x.abs() * 2.0**-4 + per_elem * 2.0**-10
        assert ((back - x).abs() <= bound + 1e-30).all(), fmt
        assert torch.equal(back[2], torch.zeros(row)), fmt
        sent = torch.empty(3, quantize.packed_row_bytes(row), dtype=torch.uint8)
        again = quantize.dequantize(*quantize.unpack(quantize.pack(codes, scales, sent), fmt, row))
        assert torch.equal(again, back), fmt  # the bytes on the wire carry it losslessly


def test_the_block_bounds_the_error_locally():
    """A large value spoils only its own block's resolution."""
    x = torch.full((1, 2 * quantize.BLOCK), 1e-3)
    x[0, 0] = 1e3
    back = quantize.dequantize(*quantize.quantize(x, "int8"))
    assert back[0, 1].item() == 0.0  # flushed in the outlier's block
    assert torch.allclose(back[0, quantize.BLOCK :], x[0, quantize.BLOCK :], rtol=1e-2)


# ---- the collective ------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 3])
def test_the_sum_is_the_fp64_sum_of_the_dequantized_chunks(dist_pools, world):
    for fmt in FORMATS:
        for rank, r in enumerate(dist_pools(world).run(collective_sum, fmt)):
            assert r["err"] <= SUM_ORDER, (fmt, rank, r)
            assert r["lossy"] > 100 * SUM_ORDER, (fmt, rank, r)  # it did quantize
            assert r["bytes"] == r["expected_bytes"], (fmt, rank, r)


# ---- one step, through fs.shard ------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 3])
def test_one_step_close_to_fp32_and_the_bytes(dist_pools, world):
    for fmt in FORMATS:
        for rank, r in enumerate(dist_pools(world).run(step_parity, fmt, False)):
            assert 0 < r["err"] < (0.01 if fmt == "int8" else 0.08), (fmt, rank, r["err"])
            wire, fp32 = r["bytes"], r["fp32_bytes"]
            assert "reduce_scatter" not in wire, (fmt, rank, wire)
            # int8/fp8: 1 byte per element + 4 bytes per 256-element block of each chunk
            assert wire["all_to_all"] == r["expected"], (fmt, rank, wire, r["expected"])
            assert fp32["reduce_scatter"] / 4 < wire["all_to_all"] < fp32["reduce_scatter"] / 3.5


@pytest.mark.slow  # four strict-semantics ranks: ~1-3 min on the 2-core box
def test_nccl_path_and_hybrid_run_clean(strict_pools):  # noqa: F811
    """The device path (``strict_async``: NCCL's semantics, virtual streams), int8 with error
    feedback: full_shard and hybrid_shard (2x2: the quantized all-to-all over the shard
    group, then the fp32 all-reduce over the replicas), close to fp32, no violation."""
    from stream_cases import assert_clean, run_stream_cases

    jobs = [
        (s, "quantized_grads_cases", "step_parity", ("int8", True, s))
        for s in ("full_shard", "hybrid_shard")
    ]
    for rank, per_label in enumerate(strict_pools(4).run(run_stream_cases, jobs, timeout=600)):
        for label, r in per_label.items():
            assert_clean(r, rank, label)
            assert 0 < r["result"]["err"] < 0.01, (label, rank, r["result"]["err"])
            assert r["result"]["bytes"]["all_to_all"] == r["result"]["expected"], (label, rank)
            assert r["collectives"].get("side", 0) > 0, r["collectives"]


@pytest.mark.parametrize("world", [2, 3])
def test_error_feedback_tracks_the_exact_accumulated_gradient(dist_pools, world):
    """The same batch 16 times, no optimizer step: without feedback the rounding repeats
    and adds up; with it the sum is off by the last residual only."""
    for fmt in FORMATS:
        for rank, r in enumerate(dist_pools(world).run(feedback_tracks, fmt)):
            assert r["feedback"] * 4 < r["plain"], (fmt, rank, r)


# ---- checkpoints ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_save_at_2_resume_at_3_on_the_same_curve(dist_pools, tmp_path, fmt):
    path = str(tmp_path / "ckpt")
    saved = dist_pools(2).run(save_run, path, fmt, 4, 4)
    resumed = dist_pools(3).run(resume_run, path, fmt, 4, 4)
    reference = saved[0]
    for rank, r in enumerate(resumed):
        for name, m in reference["residual"].items():  # the owed correction, carried exactly
            assert m.abs().max() > 0, name
            torch.testing.assert_close(
                r["residual"][name], m, rtol=1e-5, atol=1e-7, msg=f"rank {rank} {name}"
            )
        torch.testing.assert_close(r["losses"], reference["losses"], rtol=2e-3, atol=0)
    dropped = dist_pools(3).run(resume_run, path, fmt, 4, 4, False)[0]["losses"]
    assert dropped != resumed[0]["losses"]  # the residual changes the run (it was used)


@pytest.mark.slow  # a world-4 pool
def test_hybrid_save_at_4_resumes_full_shard_at_2(dist_pools, tmp_path):
    """hybrid_shard 2x2: the residuals are summed over the shard group and the replicas,
    each shard saved once per replica; restored at world 2 under full_shard, ``M`` is the same."""
    path = str(tmp_path / "ckpt")
    saved = dist_pools(4).run(save_run, path, "int8", 3, 2, "hybrid_shard")
    for rank, r in enumerate(dist_pools(2).run(resume_run, path, "int8", 3, 2)):
        for name, m in saved[0]["residual"].items():
            assert m.abs().max() > 0, name
            torch.testing.assert_close(
                r["residual"][name], m, rtol=1e-5, atol=1e-7, msg=f"rank {rank} {name}"
            )
        torch.testing.assert_close(r["losses"], saved[0]["losses"], rtol=2e-3, atol=0)


# ---- refusals ------------------------------------------------------------------------------------
def test_error_feedback_needs_a_quantized_wire():
    for reduce in (None, "bf16"):
        with pytest.raises(ValueError, match=rf"Comm\(reduce={reduce!r}, error_feedback=True\)"):
            fs.Comm(reduce=reduce, error_feedback=True)
    with pytest.raises(ValueError, match=r"Comm\(error_feedback='yes'\).*True or False"):
        fs.Comm(reduce="int8", error_feedback="yes")
    with pytest.raises(ValueError, match=r"Comm\(reduce='int4'\).*'int8', 'fp8'"):
        fs.Comm(reduce="int4")


def test_no_shard_with_error_feedback_is_refused_at_shard():
    def parse(strategy, comm):
        model = nn.Linear(2, 2)
        return parse_options(model, strategy, None, None, None, None, None, False, None, True, comm)

    with pytest.raises(ValueError, match=r"no_shard.*no quantization residual.*sharded strategy"):
        parse("no_shard", fs.Comm(reduce="int8", error_feedback=True))
    with pytest.warns(UserWarning, match="has no effect"):
        parse("no_shard", fs.Comm(reduce="fp8"))
    mp = fs.MixedPrecision(param_dtype=torch.bfloat16)  # a bf16 reduce_dtype: int8 still applies
    model = nn.Linear(2, 2)
    comm = fs.Comm(reduce="int8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_options(model, "full_shard", mp, None, None, None, None, False, None, True, comm)


def test_ranks_that_disagree_fail_at_shard(dist_pools):
    for rank, message in enumerate(dist_pools(2).run(disagree)):
        assert "ranks disagree" in message and "error_feedback=" in message, (rank, message)


# ---- the trainer (slow: three `flatshard train` launches) --------------------------------------
def _train(*args: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "flatshard.tools.cli", "train", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = Path(args[args.index("--out") + 1])
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_trainer_int8_with_error_feedback_learns_and_resumes(tmp_path):
    """``--comm.reduce int8 --comm.error_feedback true``: the loss falls well, and a run
    resumed from its step-30 checkpoint (residuals restored) follows the uninterrupted one."""
    from fault_common import TINY_TOML

    (tmp_path / "tiny.toml").write_text(TINY_TOML)
    base = ["--config", str(tmp_path / "tiny.toml"), "--nproc", "2", "--optim.decay_steps", "40",
            "--comm.reduce", "int8", "--comm.error_feedback", "true"]  # fmt: skip
    whole = _train(*base, "--steps", "40", "--out", str(tmp_path / "whole"))
    _train(*base, "--steps", "30", "--out", str(tmp_path / "part"))
    resumed = _train(*base, "--steps", "40", "--out", str(tmp_path / "part"), "--resume")
    first, last = whole[0]["loss"], sum(r["loss"] for r in whole[-5:]) / 5
    assert last < first - 1.0, (first, last)  # tiny GPT, bytes: ~5.5 -> ~3 in 40 steps
    tail = [r["loss"] for r in resumed if r["step"] > 30]
    assert len(tail) == 10, resumed
    torch.testing.assert_close(tail, [r["loss"] for r in whole[30:]], rtol=2e-2, atol=0)
