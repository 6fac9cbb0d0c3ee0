"""``flatshard train --parallelism.tp 2`` beyond the plain GPT: ``--parallelism.loss_parallel``,
``--parallel.strategy hybrid_shard`` (mesh ("replicate", "shard", "tp")) and ``--model.hf`` (a
Qwen2 save_pretrained directory: the Llama/Qwen2 plan of
``flatshard.models.tensor_parallel.parallelize_hf``, its weights read into the TP blocks).

Each runs at world 4 (dp 2 x tp 2) and must equal the same job at world 2 with tp 1 on the same
global batch, step for step (fp32, no dropout): tensor parallelism must not change the curve.
Slow-marked: six launches of 2-4 CPU workers (.ci/run's slow pass).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from fault_common import clean_env, write_inputs  # the shared tiny config and a small corpus

TOL = 1e-5  # fp32: the house bar for parity
STEPS = 3
RUN = [
    "--model.dropout", "0", "--data.rows", "1", "--log.every", "1", "--steps", str(STEPS),
    "--checkpoint.enabled", "false", "--log.plot_every", "0", "--log.val_batches", "1",
    "--precision.param_dtype", "fp32",
]  # fmt: skip


def _train(out: Path, *args: str) -> list[float]:
    cmd = [sys.executable, "-m", "flatshard.tools.cli", "train", *RUN, "--out", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def _qwen2_weights(root: Path) -> Path:
    """A tiny Qwen2 saved with its weights: both runs start from them, and the tp 2 run reads
    each rank's TP blocks from the safetensors file (a config-only start is covered by
    tests/test_meta_init_tp.py and tests/test_train_pp_hf.py)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "qwen2")
    return root / "qwen2"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("train_tp_variants")
    gpt = write_inputs(root)
    tp2, tp1 = ["--nproc", "4", "--parallelism.tp", "2"], ["--nproc", "2"]
    out = {
        "gpt_tp1": _train(root / "gpt1", *gpt, *tp1),
        "loss_parallel": _train(root / "lp", *gpt, *tp2, "--parallelism.loss_parallel", "true"),
        "hybrid": _train(root / "hy", *gpt, *tp2, "--parallel.strategy", "hybrid_shard"),
    }
    pytest.importorskip("transformers")
    hf = ["--model.hf", str(_qwen2_weights(root)), "--data", gpt[3], "--data.seq_len", "32"]
    out["hf_tp1"] = _train(root / "hf1", *hf, *tp1)
    out["hf_tp2"] = _train(root / "hf2", *hf, *tp2)
    return out | {"root": root}


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant, baseline",
    [("loss_parallel", "gpt_tp1"), ("hybrid", "gpt_tp1"), ("hf_tp2", "hf_tp1")],
)
def test_a_tp2_variant_equals_tp1_on_the_same_global_batch(runs, variant, baseline):
    got, want = runs[variant], runs[baseline]
    assert len(got) == len(want) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
    assert worst <= TOL, (variant, got, want)


@pytest.mark.slow
def test_a_tp2_hf_run_exports_the_tp1_runs_weights(runs):
    """OUT/hf/ of the tensor-parallel run (fs.save_pretrained gathers the TP blocks into global
    tensors) holds the tp 1 run's final weights, and transformers reads it back."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    root = runs["root"]
    got = load_file(root / "hf2" / "hf" / "model.safetensors")
    want = load_file(root / "hf1" / "hf" / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=2e-5, msg=name)
    model = AutoModelForCausalLM.from_pretrained(root / "hf2" / "hf")
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), got[name], rtol=0, atol=0, msg=name)
