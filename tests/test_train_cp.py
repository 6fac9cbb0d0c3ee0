"""Context parallelism: ``flatshard train --parallelism.cp N`` and the GPT's cp attention.

* The library: at dp 2 x cp 2 and dp 1 x cp 4 (world 4, ``tests/cp_cases.py``) the GPT with its
  head-tail split rows, ring (or all-gathered) keys and values and ``fs.shard`` over all ranks
  trains exactly like one process on the whole batch (float64, SGD and AdamW; every rank checks
  its own tokens' losses, the global loss and gradient norm; rank 0 the full parameters).
* Ring attention alone at cp 3 (``tests/ring_cases.py``): outputs and query, key and value
  gradients against SDPA over the whole row, in float64, fp32 and bf16.
* The trainer: ``--parallelism.cp 2`` on 4 ranks, checkpointed at step 2 and resumed to step
  3, gives the per-step losses, gradient norms, token counts and validation loss of
  ``--parallelism.cp 1`` on 2 ranks (the same global batch, fp32, no dropout).
* The layout checks refuse what cp does not support, before any worker starts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from flatshard.models.context_parallel import head_tail_indices
from flatshard.tools.train.cli import parse_config
from flatshard.tools.train.config import ParallelConfig, TrainConfig
from flatshard.tools.train.job_layout import check_layout

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from fault_common import run_train, write_inputs

from cp_cases import case_cp_matches_single_process
from ring_cases import case_ring_matches_whole_row

RUN = [
    "--model.dropout", "0",  # dropout masks depend on the rank layout: off for parity
    "--data.rows", "1",
    "--data.seq_len", "32",
    "--optim.decay_steps", "3",  # one schedule for the 2-step run and its resumed extension
    "--checkpoint.every", "2",
    "--log.every", "1",
    "--log.sample_tokens", "5",
]  # fmt: skip


def test_head_tail_split_pairs_early_and_late_chunks():
    assert head_tail_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert head_tail_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    every = torch.cat([head_tail_indices(12, 3, r) for r in range(3)])
    assert sorted(every.tolist()) == list(range(12))  # a partition of the row
    with pytest.raises(ValueError, match=r"seq_len=10 is not divisible by 2 \* cp = 4"):
        head_tail_indices(10, 2, 0)


@pytest.mark.parametrize(
    ("optimizer", "cp", "attention"),
    [("sgd", 2, "ring"), ("adamw", 2, "ring"), ("sgd", 4, "ring"), ("sgd", 2, "allgather")],
)
def test_cp_equals_one_process(dist_pools, optimizer, cp, attention):
    results = dist_pools(4).run(case_cp_matches_single_process, optimizer, "float64", cp, attention)
    assert "params" in results[0] and results[0]["param_count"] > 0
    for rank, errors in enumerate(results):
        for key in ("own_tokens", "loss", "grad_norm", "params"):
            if key in errors:
                assert errors[key] < 1e-10, (rank, key, errors)


# bound per dtype: float64 is exact to rounding; fp32 and bf16 carry their inputs' rounding
RING_BOUNDS = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 3e-2}


@pytest.mark.parametrize("dtype", list(RING_BOUNDS))
def test_ring_attention_cp3_equals_whole_row(dist_pools, dtype):
    for rank, errors in enumerate(dist_pools(3).run(case_ring_matches_whole_row, dtype)):
        for key, error in errors.items():
            assert error < RING_BOUNDS[dtype], (rank, key, errors)


@pytest.mark.slow  # three launches of the trainer (cp 2, its resume, cp 1): the slow pass
def test_train_cp2_equals_cp1_on_the_same_global_batch(tmp_path):
    base = [*write_inputs(tmp_path), *RUN]
    cp2 = [*base, "--nproc", "4", "--parallelism.cp", "2", "--out", str(tmp_path / "a")]
    first = run_train([*cp2, "--steps", "2"])
    assert first.returncode == 0, first.stderr[-3000:]
    assert "4 rank(s) (dp 2 x cp 2" in first.stdout
    resumed = run_train([*cp2, "--steps", "3", "--resume"])  # checkpointed at step 2
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "sample: 'Return the " in resumed.stdout
    cp1 = run_train([*base, "--nproc", "2", "--steps", "3", "--out", str(tmp_path / "b")])
    assert cp1.returncode == 0, cp1.stderr[-3000:]
    a, b = (_rows(tmp_path / name) for name in ("a", "b"))
    assert len(a) == len(b) == 3
    for x, y in zip(a, b, strict=True):
        assert x["tokens"] == y["tokens"], (x, y)
        for key in ("loss", "grad_norm"):
            assert abs(x[key] - y[key]) <= 1e-5 * abs(y[key]), (key, x, y)
    assert abs(a[-1]["val_loss"] - b[-1]["val_loss"]) <= 1e-5 * b[-1]["val_loss"]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_cp_is_a_parallelism_flag():
    cfg, _ = parse_config(["--parallelism.cp", "2"])
    assert cfg.parallel.cp == 2 and parse_config([])[0].parallel.cp == 1
    with pytest.raises(ValueError, match=r"parallel.cp=0 must be >= 1"):
        ParallelConfig(cp=0)
    assert parse_config([])[0].parallel.cp_attention == "auto"
    cfg, _ = parse_config(["--parallelism.cp_attention", "allgather"])
    assert cfg.parallel.cp_attention == "allgather"
    with pytest.raises(ValueError, match=r"parallel.cp_attention='flash'"):
        ParallelConfig(cp_attention="flash")


@pytest.mark.parametrize(
    ("args", "world", "message"),
    [
        (["--parallelism.cp", "3"], 4, r"parallel.cp=3 does not divide the world size 4"),
        (["--parallelism.cp", "2", "--data.seq_len", "30"], 4,
         r"data.seq_len=30 is not divisible by 2 \* parallel.cp = 4"),
        (["--parallelism.cp", "2", "--parallelism.tp", "2"], 4,
         r"parallel.cp=2 with parallel.tp=2 is not supported yet; pass --parallelism.tp 1"),
        (["--parallelism.cp", "2", "--parallelism.pp", "2", "--model.tie_embeddings", "false"],
         4, r"parallel.cp=2 with parallel.pp=2 is not supported yet"),
        (["--parallelism.cp", "2", "--model.experts", "2"], 2,
         r"parallel.cp=2 is for the dense GPT, not model.experts=2"),
    ],
)  # fmt: skip
def test_layouts_cp_refuses(args, world, message):
    cfg, _ = parse_config(args)
    assert isinstance(cfg, TrainConfig)
    with pytest.raises(ValueError, match=message):
        check_layout(cfg, world)
