"""Issue 8, item 6: bad inputs are a clear error or a documented, counted skip.

Config: zero/negative sizes, an unknown strategy or policy, a model shape the GPT cannot build,
a world size that is not a multiple of the hybrid mesh -- errors before any worker starts.
Data: empty documents (skipped, counted), over-long documents (cut into pieces), non-UTF-8 bytes
(an error naming file and byte). Token ids out of range cannot come from the byte tokenizer.
NaN/inf loss (fp32 and bf16, on one rank only): ``optim.nonfinite="error"`` stops every rank
with the step named; ``"skip"`` skips the update on every rank and counts it.
(Also covered elsewhere: bad data files through the CLI in test_train_data.py, bad fs.shard
arguments -- unknown strategy, 1-D mesh for hybrid_shard -- in test_engine_api.py.)
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from flatshard.tools.train.build import Env, _hybrid_mesh
from flatshard.tools.train.cli import main
from flatshard.tools.train.config import (
    CheckpointConfig,
    DataConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    PrecisionConfig,
    TrainConfig,
)
from flatshard.tools.train.config_io import apply_overrides
from flatshard.tools.train.data import TOKENIZER, load_corpus
from flatshard.tools.train.resolve import gpt_config, resolve


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("steps", "0", "steps=0 must be >= 1"),
        ("data.rows", "0", "data.rows=0 must be >= 1"),
        ("data.seq_len", "1", "data.seq_len=1 must be >= 2"),
        ("data.micro_batches", "-2", "data.micro_batches=-2 must be >= 1"),
        ("model.d_model", "-8", "model.d_model=-8 must be >= 0"),
        ("parallel.nproc", "-1", "parallel.nproc=-1 must be >= 0"),
        ("parallel.timeout_s", "0", "parallel.timeout_s=0.0 is outside (0.0, inf]"),
        ("parallel.max_restarts", "-1", "parallel.max_restarts=-1 must be >= 0"),
        ("parallel.strategy", "zero3", "parallel.strategy='zero3' is not supported; use one of"),
        ("optim.nonfinite", "ignore", "optim.nonfinite='ignore' is not supported; use one of"),
        ("checkpoint.keep", "0", "checkpoint.keep=0 must be >= 1"),
    ],
)
def test_bad_settings_are_named(key, value, message):
    with pytest.raises(ValueError) as err:
        apply_overrides(TrainConfig(), [(key, value)])
    assert message in str(err.value)


def test_a_model_shape_the_gpt_cannot_build_fails_before_launch(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["--model.d_model", "32", "--model.n_heads", "3", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "d_model=32 is not divisible by n_heads=3" in err
    assert not out.exists()  # no worker started


def test_world_not_a_multiple_of_the_hybrid_mesh():
    with pytest.raises(ValueError, match="world size 3 is not a multiple of 2 workers here"):
        _hybrid_mesh(Env(rank=0, world=3, local_world=2, device=torch.device("cpu")))


def test_empty_long_and_non_utf8_documents(tmp_path):
    long_text = "x" * 1000
    rows = [{"text": "short one"}, {"text": "   "}, {"text": ""}, {"text": long_text}]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    corpus = load_corpus(DataConfig(path=str(path), seq_len=64, val_fraction=0.0))
    assert "2 empty skipped" in corpus.source  # counted, and shown in the run's header
    assert all(2 <= len(piece) <= 64 for piece in corpus.train)
    tokens = [t for piece in corpus.train for t in piece]
    assert tokens.count(TOKENIZER.encode("x", add_eos=False)[0]) == 1000  # cut, nothing lost
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(
        ValueError, match=r"bad\.jsonl: not valid UTF-8 at byte offset 30 \(line 2\)"
    ):
        load_corpus(DataConfig(path=str(bad)))


def test_token_ids_always_fit_the_model():
    cfg = resolve(TrainConfig(), cuda=False, local_world=1)
    ids = TOKENIZER.encode("caf\u00e9 \U0001f600", add_eos=True)
    assert max(ids) < gpt_config(cfg).vocab_size and TOKENIZER.vocab_size <= 258
    from flatshard.models import GPT

    model = GPT(gpt_config(cfg))  # a foreign id reaches the embedding: torch's IndexError
    with pytest.raises(IndexError):
        model(torch.tensor([[1, gpt_config(cfg).vocab_size]]))


def _tiny_run(policy: str, dtype: str, docs: str, out: str):
    from flatshard.tools.train.session import setup

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = TrainConfig(
        steps=3, out=out,
        model=ModelConfig(d_model=32, n_layers=1, n_heads=2),
        data=DataConfig(path=docs, seq_len=32, rows=1, val_fraction=0.0),
        precision=PrecisionConfig(param_dtype=dtype),
        optim=OptimConfig(nonfinite=policy, warmup_steps=0),
        checkpoint=CheckpointConfig(enabled=False),
        log=LogConfig(val_batches=0, sample_tokens=0),
    )  # fmt: skip
    cfg = resolve(cfg, cuda=False, local_world=world)
    run, _ = setup(cfg, Env(rank, world, world, torch.device("cpu")), resume=False)
    return run


def case_nonfinite(policy: str, dtype: str, poison: float, docs: str, out: str) -> dict:
    """Three steps; rank 1's logits times ``poison`` in step 2 only."""
    from flatshard.tools.train.data import endless
    from flatshard.tools.train.trainer import train_loop

    run = _tiny_run(policy, dtype, docs, out)
    run.stream = endless(run.sampler)
    seen: dict[int, list[torch.Tensor]] = {}

    def before(module, args):
        seen[run.step] = [p.detach().clone() for p in run.model.parameters()]

    def spoil(module, args, output):
        return output * poison if run.step == 1 and dist.get_rank() == 1 else output

    run.model.register_forward_pre_hook(before)
    run.model.register_forward_hook(spoil)
    try:
        train_loop(run, save=None)
    except FloatingPointError as err:
        return {"error": str(err), "at": run.step}
    final = [p.detach().clone() for p in run.model.parameters()]

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    return {
        "skipped": run.skipped_steps,
        "row": run.last["skipped_steps"],
        "step_2_skipped": same(seen[1], seen[2]),
        "step_3_applied": not same(seen[2], final),
        "loss_3_finite": bool(torch.isfinite(torch.tensor(run.last["loss"]))),
    }


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("nonfinite") / "docs.jsonl"
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog"]
    text = [" ".join(words[i % 9 :] + words[: i % 9]) * 3 for i in range(60)]
    path.write_text("\n".join(json.dumps({"text": t}) for t in text) + "\n", encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(("dtype", "poison"), [("fp32", float("nan")), ("bf16", float("inf"))])
def test_nonfinite_loss_is_an_error_naming_the_step(dist_pools, docs, tmp_path, dtype, poison):
    results = dist_pools(2).run(case_nonfinite, "error", dtype, poison, docs, str(tmp_path))
    for r in results:  # every rank stops at the same step, none hangs
        assert r["at"] == 1 and "step 2: the loss is nan" in r["error"], r
        assert "optim.nonfinite=skip" in r["error"]


@pytest.mark.parametrize(("dtype", "poison"), [("fp32", float("inf")), ("bf16", float("nan"))])
def test_nonfinite_loss_is_skipped_on_every_rank(dist_pools, docs, tmp_path, dtype, poison):
    results = dist_pools(2).run(case_nonfinite, "skip", dtype, poison, docs, str(tmp_path))
    for r in results:
        assert r == {"skipped": 1, "row": 1, "step_2_skipped": True, "step_3_applied": True,
                     "loss_3_finite": True}, r  # fmt: skip
