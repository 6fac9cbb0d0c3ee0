"""``flatshard train --model.hf DIR --parallelism.pp 2``: a transformers Llama cut into stages.

The runs (fp32, the same seed and data, a 4-layer Llama with untied embeddings) must equal
their 1-D run, dp 2 at world 2 without a pipeline, step for step: losses, gradient norms,
validation losses and tokens.

* **From a config** (random init on the meta device): A is pp 2 x dp 2 at world 4, checkpointed
  at step 2; B the dp 2 run. Every stage initialises as the unsplit model does, so A's first
  loss is B's. C resumes A's step-2 checkpoint at dp 2 without pp and continues B's curve.
* **From a save_pretrained directory** (fine-tuning): F (pp 2 x dp 2) and G (dp 2) both read
  the weights, each stage its own slices.

In this process: the stages chained give the unsplit model's logits on packed rows (documents
kept apart by position resets alone), for Llama, Qwen2's and Mistral's sliding-window layers;
the initialisation replay gives the unsplit numbers; and the refusals.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from flatshard.tools.train.cli import main
from flatshard.tools.train.pipeline_hf import HFStage, init_states
from flatshard.tools.train.pipeline_stage import layer_split

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from fault_common import assert_same_curve, metrics, run_train, write_inputs

RUN = [
    "--model.dropout", "0", "--data.seq_len", "32", "--data.rows", "4",
    "--optim.decay_steps", "6", "--optim.lr", "3e-3",
    "--log.every", "1", "--log.val_every", "2", "--log.sample_tokens", "0",
    "--log.plot_every", "0", "--steps", "3",
]  # fmt: skip
CKPT = ["--checkpoint.every", "2", "--checkpoint.enabled", "true"]
NO_CKPT = ["--checkpoint.enabled", "false"]
PP = ["--nproc", "4", "--parallelism.pp", "2"]
DP = ["--nproc", "2"]


def _llama_config(**overrides):
    from transformers import LlamaConfig

    kwargs = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False)  # fmt: skip
    return LlamaConfig(**(kwargs | overrides))


def _llama_dir(root: Path, weights: bool = False) -> Path:
    """A tiny Llama: its config.json only, or a save_pretrained directory."""
    from transformers import AutoModelForCausalLM

    where = root / ("llama_weights" if weights else "llama")
    if weights:
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(_llama_config())
        with torch.no_grad():  # far from any fresh init: the runs' first loss shows the load
            model.lm_head.weight.mul_(30)
        model.save_pretrained(where)
    else:
        _llama_config().save_pretrained(where)
    return where


def _train(*args: str) -> subprocess.CompletedProcess:
    proc = run_train(list(args), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("train_pp_hf")
    base = [*write_inputs(root), *RUN, "--model.hf", str(_llama_dir(root))]
    done = {
        "a": _train(*base, *PP, *CKPT, "--out", str(root / "a")),
        "b": _train(*base, *DP, *NO_CKPT, "--out", str(root / "b")),
    }
    shutil.copytree(root / "a" / "checkpoints" / "step_000002",
                    root / "c" / "checkpoints" / "step_000002")  # fmt: skip
    done["c"] = _train(*base, *DP, *CKPT, "--resume", "--out", str(root / "c"))
    tuned = [*write_inputs(root), *RUN, "--model.hf", str(_llama_dir(root, weights=True))]
    done["f"] = _train(*tuned, *PP, *NO_CKPT, "--out", str(root / "f"))
    done["g"] = _train(*tuned, *DP, *NO_CKPT, "--out", str(root / "g"))
    return {name: (proc.stdout, metrics(root / name)) for name, proc in done.items()}


@pytest.mark.slow  # five launches of 2-4 CPU workers (~2 min on the shared 2-core box)
def test_pp_llama_from_a_config_equals_the_1d_run_step_for_step(runs):
    out, rows = runs["a"]
    assert "4 rank(s) (pp 2 x dp 2, 1F1B, 4 microbatches)" in out
    assert "LlamaForCausalLM from" in out and "no hf/ export" in out
    assert_same_curve(rows, runs["b"][1])
    assert rows[-1]["loss"] < rows[0]["loss"]  # it learns


@pytest.mark.slow
def test_a_pp_llama_checkpoint_resumes_without_pp(runs):
    out, rows = runs["c"]
    assert "resumed from" in out and "step_000002" in out
    assert_same_curve([r for r in rows if r["step"] == 3], runs["b"][1][2:])


@pytest.mark.slow
def test_pp_llama_finetuning_from_weights_equals_the_1d_run(runs):
    assert_same_curve(runs["f"][1], runs["g"][1])
    assert runs["f"][1][0]["loss"] > runs["a"][1][0]["loss"] + 0.5  # the weights, not an init


def _packed_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of 16 tokens, each several documents (positions restart at every one)."""
    ids = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7],
                              [0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1, 0, 1, 2, 3, 4]])  # fmt: skip
    return ids, positions


def _model(config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _chained(model, n_stages: int, ids, positions) -> torch.Tensor:
    split = layer_split(model.config.num_hidden_layers, n_stages)
    last = n_stages - 1
    stages = [HFStage(model, split[s], first=s == 0, last=s == last) for s in range(n_stages)]
    names = sorted(name for stage in stages for name, _ in stage.named_parameters())
    assert names == sorted(name for name, _ in model.named_parameters())  # topology-free
    x = ids
    for stage in stages:
        x = stage(x, positions)
    return x


def _configs() -> dict:
    from transformers import MistralConfig, Qwen2Config

    small = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 tie_word_embeddings=False)  # fmt: skip
    qwen2 = Qwen2Config(**small, use_sliding_window=True, sliding_window=3, max_window_layers=2,
                        layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2)  # fmt: skip
    return {"llama": _llama_config(), "qwen2": qwen2,
            "mistral": MistralConfig(**small, sliding_window=3)}  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_stages_chained_equal_the_unsplit_model_on_packed_rows(arch):
    """The stages rebuild the unsplit model's rotary positions and per-document (and
    sliding-window) masks from position_ids alone; the rows pack several documents."""
    model = _model(_configs()[arch])
    ids, positions = _packed_rows()
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        for n_stages in (2, 3):
            got = _chained(model, n_stages, ids, positions)
            assert (got - want).abs().max().item() < 1e-5, n_stages
        # and the documents are kept apart: a document alone gives the same logits
        alone = model(input_ids=ids[:1, 5:8], use_cache=False).logits
        assert (_chained(model, 2, ids, positions)[:1, 5:8] - alone).abs().max() < 1e-5


def test_the_init_replay_gives_each_module_the_unsplit_generator_state():
    """init_states + each module initialised from its recorded state give the numbers of
    the unsplit meta model initialised in fs.shard's unit order (layers, then the root)."""
    from transformers import AutoModelForCausalLM

    config, device = _llama_config(), torch.device("cpu")
    torch.manual_seed(5)
    with device:  # the reference: whole modules initialised in the unit order, for real
        whole = AutoModelForCausalLM.from_config(config)
    torch.manual_seed(5)
    for unit in [*whole.model.layers, whole]:
        skip = {id(layer) for layer in whole.model.layers if layer is not unit}
        _apply_skipping(whole, unit, skip)
    want = {name: p.detach().clone() for name, p in whole.named_parameters()}
    torch.manual_seed(5)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    states = init_states(meta, device)
    # a stage's view: the last layer and the head, initialised out of order
    for name in ["lm_head", "model.layers.3.mlp.down_proj", "model.embed_tokens"]:
        module = whole.get_submodule(name)
        torch.manual_seed(123)  # whatever state the stage's generator is in
        torch.set_rng_state(states[name])
        whole._init_weights(module)
        torch.testing.assert_close(module.weight, want[f"{name}.weight"], rtol=0, atol=0)


def _apply_skipping(model, unit, skip: set[int]) -> None:
    def walk(module):
        for child in module.children():
            if id(child) not in skip:
                walk(child)
        model._init_weights(module)

    walk(unit)


def test_an_unsupported_architecture_cannot_be_cut():
    from transformers import GPT2Config

    model = _model(GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=2, n_positions=64))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel cannot be cut.*--parallelism\.pp 1"):
        HFStage(model, range(1), first=True, last=False)


@pytest.mark.parametrize(
    ("kind", "extra", "message"),
    [
        ("gpt2", [], "is a GPT2LMHeadModel: parallel.pp=2 cuts only the Llama layout"),
        ("tied", [], "has tie_word_embeddings=true, which parallel.pp=2"),
        ("llama", ["--parallelism.tp", "2", "--nproc", "8"],
         "with parallel.pp=2 and parallel.tp=2 is not supported yet"),
        ("llama", ["--parallelism.stages_per_rank", "4", "--parallelism.schedule",
                   "Interleaved1F1B"], "8 pipeline stages need at least 8 decoder layers"),
    ],
)  # fmt: skip
def test_unusable_hf_pipelines_are_refused_before_any_worker_starts(
    kind, extra, message, tmp_path, monkeypatch, capsys
):
    from transformers import GPT2Config

    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    configs = {
        "gpt2": GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=2),
        "tied": _llama_config(tie_word_embeddings=True),
        "llama": _llama_config(),
    }
    configs[kind].save_pretrained(tmp_path / kind)
    args = [*PP, "--model.hf", str(tmp_path / kind), *NO_CKPT, *extra]
    assert main([*args, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
