"""``flatshard train --parallelism.pp 2``: 4 local CPU ranks as 2 pp x 2 dp.

One module fixture launches, on the same global batch (same seed and data order, fp32, no
dropout, the default tied embedding/head: the last stage holds a copy kept equal by
``fs.tie_across_stages``): A pp 2 x dp 2 under 1F1B, 2 steps and a checkpoint (one checkpoint
of both stages, ``fs.save(across=pp)``), resumed to step 3; C pp 2 x dp 2 under ZBVZeroBubble
(two stages per rank, V-shaped, split backward); B dp 2 at world 2 (no pipeline, a checkpoint
at step 2); D dp 2 without a pipeline resumed from A's step-2 checkpoint; E pp 2 x dp 2
resumed from B's. Cutting the GPT into stages must not change the curve: A's, C's, D's and E's
per-step losses, gradient norms, validation losses (and A's and C's final text sample) equal
B's. The other tests run in this process: the stage cut
against the whole GPT, and the refusals before any worker starts.
"""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from flatshard.models import GPT, GPTConfig
from flatshard.packing import collate
from flatshard.tools.train.cli import main, parse_config
from flatshard.tools.train.pipeline import stage_indices
from flatshard.tools.train.pipeline_stage import GPTStage, cu_seqlens_from_positions, layer_split

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from fault_common import metrics, run_train, write_inputs  # the shared tiny config, a small corpus

TOL = 1e-5  # fp32: the house bar for parity
RUN = [
    "--model.dropout", "0",  # dropout masks depend on the rank layout: off for parity
    "--model.n_layers", "4",  # 4 stages for ZBV (2 per rank)
    "--data.rows", "4",  # 4 pipeline microbatches of one row
    "--optim.decay_steps", "6",
    "--log.every", "1", "--log.val_every", "2", "--log.sample_tokens", "6",
    "--steps", "3",
]  # fmt: skip


CKPT = ["--checkpoint.every", "2", "--checkpoint.enabled", "true"]
NO_CKPT = ["--checkpoint.enabled", "false"]


def _train(*args: str):
    return run_train(list(args))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("train_pp")
    base = [*write_inputs(root), *RUN]
    pp = ["--nproc", "4", "--parallelism.pp", "2"]
    done = {}
    first = _train(*base, *pp, "--steps", "2", *CKPT, "--out", str(root / "a"))
    assert first.returncode == 0, first.stderr[-3000:]  # A: 2 steps, a checkpoint, resumed
    done["a"] = _train(*base, *pp, *CKPT, "--resume", "--out", str(root / "a"))
    done["c"] = _train(*base, *pp, *NO_CKPT, "--parallelism.schedule", "ZBVZeroBubble", "--out",
                       str(root / "c"))  # fmt: skip
    done["b"] = _train(*base, "--nproc", "2", *CKPT, "--out", str(root / "b"))
    for source, target, layout in (("a", "d", ["--nproc", "2"]), ("b", "e", pp)):
        shutil.copytree(root / source / "checkpoints" / "step_000002",
                        root / target / "checkpoints" / "step_000002")  # fmt: skip
        done[target] = _train(*base, *layout, *CKPT, "--resume", "--out", str(root / target))
    for name, proc in done.items():
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
    return {name: (proc.stdout, metrics(root / name)) for name, proc in done.items()}


def _sample(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("sample: "))


@pytest.mark.slow  # three launches of 3 steps (~2 min on the shared 2-core box)
@pytest.mark.parametrize("name", ["a", "c"])
def test_pipeline_equals_the_unpipelined_run_step_for_step(runs, name):
    out, rows = runs[name]
    _, ref = runs["b"]
    schedule = "1F1B" if name == "a" else "ZBVZeroBubble"
    assert f"4 rank(s) (pp 2 x dp 2, {schedule}, 4 microbatches)" in out
    assert len(rows) == len(ref) == 3 and all(math.isfinite(r["loss"]) for r in rows)
    for got, want in zip(rows, ref, strict=True):
        for key in ("loss", "grad_norm", "val_loss"):
            if want.get(key) is not None:
                assert abs(got[key] - want[key]) <= TOL * abs(want[key]), (key, got, want)
        assert got["tokens"] == want["tokens"]
    assert _sample(out) == _sample(runs["b"][0])  # the last stage samples, pp broadcasts


@pytest.mark.slow
def test_pipeline_resume_continues_the_same_curve(runs):
    out, rows = runs["a"]
    assert "resumed from" in out and "step_000002" in out
    assert [r["step"] for r in rows] == [1, 2, 3]  # the curve up to the checkpoint, then on


@pytest.mark.slow
@pytest.mark.parametrize("name", ["d", "e"])
def test_a_checkpoint_resumes_with_or_without_the_pipeline(runs, name):
    """One checkpoint of both stages, whole-model names: a dp 2 run without pp continues A's
    (D), and a pp 2 x dp 2 run continues B's (E): the tied head's copy reads its own keys."""
    out, rows = runs[name]
    assert "resumed from" in out
    step3 = next(r for r in rows if r["step"] == 3)
    want = runs["b"][1][2]
    assert abs(step3["loss"] - want["loss"]) <= TOL * abs(want["loss"]), (step3, want)
    assert abs(step3["grad_norm"] - want["grad_norm"]) <= TOL * want["grad_norm"]


def test_stages_chained_equal_the_whole_gpt_and_keep_its_names():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, d_model=16, n_layers=5, n_heads=2, max_seq_len=16,
                          tie_embeddings=False))  # fmt: skip
    docs = [list(range(1, 6)), list(range(3, 14)), list(range(2, 9)), [7, 8, 9]]
    b = collate(docs, 16, pad_id=0, rows=2)
    want = model(b.input_ids, b.position_ids, b.cu_seqlens, b.max_seqlen)  # [2, 16, 32]
    split = layer_split(5, 3)
    assert [list(r) for r in split] == [[0, 1], [2, 3], [4]]
    stages = [GPTStage(model, r, first=i == 0, last=i == 2) for i, r in enumerate(split)]
    x = b.input_ids
    for stage in stages:
        x = stage(x, b.position_ids)
    torch.testing.assert_close(x, want, rtol=0, atol=0)
    names = [n for stage in stages for n, _ in stage.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert any(n.startswith("layers.3.") for n, _ in stages[1].named_parameters())
    cu, longest = cu_seqlens_from_positions(b.position_ids)
    assert cu.tolist() == b.cu_seqlens.tolist() and cu.dtype == torch.int32
    assert longest == int((b.cu_seqlens[1:] - b.cu_seqlens[:-1]).max())


def test_a_tied_gpt_cut_gives_the_last_stage_an_equal_copy():
    model = GPT(GPTConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, max_seq_len=16))
    first = GPTStage(model, range(1), first=True, last=False)
    last = GPTStage(model, range(1, 2), first=False, last=True)
    assert last.lm_head.weight is not first.tok_emb.weight  # one copy per stage
    assert torch.equal(last.lm_head.weight, first.tok_emb.weight)
    both = GPTStage(model, range(2), first=True, last=True)  # one stage: still one weight
    assert both.lm_head.weight is both.tok_emb.weight


def test_stage_placement_looped_and_v():
    assert [stage_indices(r, 2, 2, "Interleaved1F1B") for r in (0, 1)] == [[0, 2], [1, 3]]
    assert [stage_indices(r, 2, 2, "ZBVZeroBubble") for r in (0, 1)] == [[0, 3], [1, 2]]
    assert stage_indices(3, 4, 1, "1F1B") == [3]


def test_pipeline_options_parse():
    cfg, _ = parse_config(["--parallelism.pp", "2", "--parallelism.schedule", "GPipe",
                           "--parallelism.microbatches", "4"])  # fmt: skip
    assert (cfg.parallel.pp, cfg.parallel.schedule, cfg.parallel.microbatches) == (2, "GPipe", 4)
    with pytest.raises(ValueError, match=r"parallel\.schedule='Zigzag' is not supported"):
        parse_config(["--parallelism.schedule", "Zigzag"])


PP = ["--nproc", "4", "--parallelism.pp", "2", "--checkpoint.enabled", "false"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "4", "--parallelism.pp", "3"],
         "parallel.pp=3 does not divide the world size 4"),
        ([*PP, "--data.rows", "3", "--parallelism.microbatches", "2"],
         "parallel.microbatches=2 does not divide the 3 rows"),
        ([*PP, "--data.rows", "1"], "parallel.microbatches=1 is fewer than schedule 1F1B needs"),
        ([*PP, "--parallelism.schedule", "DualPipeV", "--data.rows", "2"],
         "parallel.microbatches=2 is fewer than schedule DualPipeV needs: at least the 4"),
        ([*PP, "--parallelism.schedule", "Interleaved1F1B", "--model.n_layers", "3"],
         "4 pipeline stages need at least 4 blocks"),
        ([*PP, "--parallelism.schedule", "1F1B", "--parallelism.stages_per_rank", "2"],
         "schedule 1F1B holds exactly 1 stage"),
    ],
)  # fmt: skip
def test_unusable_pipelines_are_refused_before_any_worker_starts(
    args, message, tmp_path, monkeypatch, capsys
):
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    assert main([*args, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
