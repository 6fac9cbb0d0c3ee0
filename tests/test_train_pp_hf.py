"""``flatshard train --model.hf DIR --parallelism.pp 2``: a transformers Llama cut into stages.

The runs (fp32, the same seed and data, a 4-layer Llama, untied unless said) must equal
their 1-D run, dp 2 at world 2 without a pipeline, step for step: losses, gradient norms,
validation losses and tokens.

* **From a config** (random init on the meta device): A is pp 2 x dp 2 at world 4, checkpointed
  at step 2; B the dp 2 run. Every stage initialises as the unsplit model does, so A's first
  loss is B's. C resumes A's step-2 checkpoint at dp 2 without pp and continues B's curve.
* **From a save_pretrained directory** (fine-tuning): F (pp 2 x dp 2) and G (dp 2) both read
  the weights, each stage its own slices.
* **Tied embeddings** (``tied_runs``): from a config under ZBVZeroBubble and from weights
  under 1F1B, against their dp 2 runs.

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
PP_TP = ["--parallelism.tp", "2", "--parallelism.schedule", "Interleaved1F1B",
         "--parallelism.stages_per_rank", "2"]  # fmt: skip
PP = ["--nproc", "4", "--parallelism.pp", "2"]
DP = ["--nproc", "2"]


def _llama_config(**overrides):
    from transformers import LlamaConfig

    kwargs = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False)  # fmt: skip
    return LlamaConfig(**(kwargs | overrides))


def _llama_dir(root: Path, weights: bool = False, tied: bool = False) -> Path:
    """A tiny Llama: its config.json only, or a save_pretrained directory (a tied one holds
    the shared matrix once, as ``model.embed_tokens.weight``)."""
    from transformers import AutoModelForCausalLM

    config = _llama_config(tie_word_embeddings=tied)
    where = root / f"llama{'_weights' if weights else ''}{'_tied' if tied else ''}"
    if weights:
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():  # far from any fresh init: the runs' first loss shows the load
            model.lm_head.weight.mul_(30)
        model.save_pretrained(where)
    else:
        config.save_pretrained(where)
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
    runs = {name: (proc.stdout, metrics(root / name)) for name, proc in done.items()}
    return runs | {"root": root}


@pytest.mark.slow  # five launches of 2-4 CPU workers (~2 min on the shared 2-core box)
def test_pp_llama_from_a_config_equals_the_1d_run_step_for_step(runs):
    out, rows = runs["a"]
    assert "4 rank(s) (pp 2 x dp 2, 1F1B, 4 microbatches)" in out
    assert "LlamaForCausalLM from" in out and "hf/ (from_pretrained)" in out
    assert_same_curve(rows, runs["b"][1])
    assert rows[-1]["loss"] < rows[0]["loss"]  # it learns
    # OUT/hf: the pipelined run's final weights, gathered from both stages, are the 1-D run's
    got, want = _exported(runs["root"] / "a"), _exported(runs["root"] / "b")
    assert sorted(got) == sorted(want) and len(got) == 2 + 9 * 4 + 1  # embed, head, layers, norm
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=2e-5, msg=name)
    _from_pretrained_holds(runs["root"] / "a" / "hf", got)


@pytest.mark.slow
def test_a_pp_llama_checkpoint_resumes_without_pp(runs):
    out, rows = runs["c"]
    assert "resumed from" in out and "step_000002" in out
    assert_same_curve([r for r in rows if r["step"] == 3], runs["b"][1][2:])


@pytest.mark.slow
def test_pp_llama_finetuning_from_weights_equals_the_1d_run(runs):
    assert_same_curve(runs["f"][1], runs["g"][1])
    assert runs["f"][1][0]["loss"] > runs["a"][1][0]["loss"] + 0.5  # the weights, not an init


@pytest.fixture(scope="module")
def tied_runs(tmp_path_factory) -> dict:
    """A Llama with tie_word_embeddings, from a config and from weights (the file holds the
    matrix once). T runs ZBVZeroBubble (pp 2, 2 stages per rank: both ends of the tie on pp
    rank 0), V 1F1B (the ends on two pp ranks); U and W are their dp 2 runs. X is pp 2 x tp 2
    from the weights under Interleaved1F1B (2 stages per rank, the tied copies split over tp),
    Y its world-1 run; XC and YC the same two from the config."""
    root = tmp_path_factory.mktemp("train_pp_hf_tied")
    inputs = write_inputs(root)
    config = [*inputs, *RUN, "--model.hf", str(_llama_dir(root, tied=True))]
    weights = [*inputs, *RUN, "--model.hf", str(_llama_dir(root, weights=True, tied=True))]
    zbv = [*PP, "--parallelism.schedule", "ZBVZeroBubble", "--parallelism.stages_per_rank", "2"]
    done = {
        "t": _train(*config, *zbv, *NO_CKPT, "--out", str(root / "t")),
        "u": _train(*config, *DP, *NO_CKPT, "--out", str(root / "u")),
        "v": _train(*weights, *PP, *NO_CKPT, "--out", str(root / "v")),
        "w": _train(*weights, *DP, *NO_CKPT, "--out", str(root / "w")),
        "x": _train(*weights, *PP, *PP_TP, *NO_CKPT, "--out", str(root / "x")),
        "y": _train(*weights, "--nproc", "1", *NO_CKPT, "--out", str(root / "y")),
        "xc": _train(*config, *PP, *PP_TP, *NO_CKPT, "--out", str(root / "xc")),
        "yc": _train(*config, "--nproc", "1", *NO_CKPT, "--out", str(root / "yc")),
    }  # fmt: skip
    runs = {name: (proc.stdout, metrics(root / name)) for name, proc in done.items()}
    return runs | {"root": root}


@pytest.mark.slow  # four launches of 2-4 CPU workers
def test_pp_tied_llama_equals_the_1d_run_step_for_step(tied_runs):
    """Both copies start at the unsplit matrix and take the sum of both uses' gradients:
    the V-shaped run (the tie within one rank) and the 1F1B run from weights (the head's copy
    read from model.embed_tokens.weight, the tie across pp ranks) follow their dp 2 runs."""
    out, rows = tied_runs["t"]
    assert "ZBVZeroBubble" in out
    assert_same_curve(rows, tied_runs["u"][1])
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert_same_curve(tied_runs["v"][1], tied_runs["w"][1])
    assert tied_runs["v"][1][0]["loss"] > rows[0]["loss"] + 0.5  # the weights, not an init
    # OUT/hf: both copies written, equal, and the 1-D run's one matrix
    # T keeps no checkpoints: its export went through a weights-only one, removed after
    assert not (tied_runs["root"] / "t" / ".hf_export_checkpoint").exists()
    got, want = _exported(tied_runs["root"] / "t"), _exported(tied_runs["root"] / "u")
    assert "lm_head.weight" in got and "lm_head.weight" not in want
    torch.testing.assert_close(got["lm_head.weight"], got["model.embed_tokens.weight"])
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=2e-5, msg=name)


@pytest.mark.slow
def test_pp_tp_tied_llama_equals_the_world_1_run(tied_runs):
    """3-D with a transformers model: the stages made tensor-parallel (sequence parallel, the
    stream crossing stages as sequence shards), two per rank, the tie summed per tp rank; the
    curve and OUT/hf equal the one-process run's."""
    out, rows = tied_runs["x"]
    assert "(pp 2 x dp 1 x tp 2, Interleaved1F1B, 4 microbatches)" in out
    assert_same_curve(rows, tied_runs["y"][1])
    got, want = _exported(tied_runs["root"] / "x"), _exported(tied_runs["root"] / "y")
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=2e-5, msg=name)


@pytest.mark.slow
def test_pp_tp_tied_llama_from_a_config_equals_the_world_1_run(tied_runs):
    """From a config too: each TP parameter is drawn whole and cut to its block
    (core/meta_init.py), so the stages start from the unsplit model's numbers at tp 2."""
    assert_same_curve(tied_runs["xc"][1], tied_runs["yc"][1])
    assert tied_runs["xc"][1][0]["loss"] < tied_runs["x"][1][0]["loss"] - 0.5  # an init


def _exported(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "hf" / "model.safetensors")


def _from_pretrained_holds(where: Path, tensors: dict) -> None:
    """transformers reads the directory back: its model holds exactly the written tensors."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(where)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), tensors[name], rtol=0, atol=0, msg=name)


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
    assert names == sorted(model.state_dict())  # topology-free (a tied head: both names)
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
            "mistral": MistralConfig(**small, sliding_window=3),
            "llama_tied": _llama_config(tie_word_embeddings=True)}  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "llama_tied"])
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


def test_tied_stages_start_both_copies_at_the_unsplit_matrix():
    """[Note: tied embeddings in HF stages]: the unsplit model's shared matrix takes the
    embedding's draw, then the head's. The first stage's embedding and the last stage's own
    copy of the head, each initialised from the replayed states (last stage first, from
    another generator state), both hold that value, in parameters of their own."""
    from transformers import AutoModelForCausalLM

    from flatshard.tools.train.pipeline_hf import _stage_init

    config, device = _llama_config(tie_word_embeddings=True), torch.device("cpu")
    torch.manual_seed(5)
    whole = AutoModelForCausalLM.from_config(config)
    assert whole.lm_head.weight is whole.model.embed_tokens.weight
    torch.manual_seed(5)
    for unit in [*whole.model.layers, whole]:
        _apply_skipping(whole, unit, {id(x) for x in whole.model.layers if x is not unit})
    want = whole.lm_head.weight.detach().clone()
    torch.manual_seed(5)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    states = init_states(meta, device)
    first = HFStage(meta, range(0, 2), first=True, last=False)
    last = HFStage(meta, range(2, 4), first=False, last=True)
    for stage in (last, first):
        stage.to_empty(device=device)
        torch.manual_seed(123)
        _stage_init(meta, stage, states, device)(stage)
    assert last.lm_head.weight is not first.model.embed_tokens.weight
    torch.testing.assert_close(first.model.embed_tokens.weight, want, rtol=0, atol=0)
    torch.testing.assert_close(last.lm_head.weight, want, rtol=0, atol=0)
    torch.testing.assert_close(last.model.norm.weight, whole.model.norm.weight, rtol=0, atol=0)


def test_the_weights_loader_reads_a_tied_copy_from_its_source():
    """save_pretrained writes a tied matrix once (model.embed_tokens.weight): the last stage's
    head copy names that source, as transformers' _tied_weights_keys does; an untied model's
    class-level mapping is not followed (its config unties), nor is a name the file has."""
    from types import SimpleNamespace

    from flatshard.checkpoint.sliced import _sources, _tied_sources

    with torch.device("meta"):
        tied, untied = (_model(_llama_config(tie_word_embeddings=t)) for t in (True, False))
    last = HFStage(tied, range(2, 4), first=False, last=True)
    assert _tied_sources(last) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert _tied_sources(untied) == {}
    assert _tied_sources(HFStage(untied, range(2, 4), first=False, last=True)) == {}
    layout = SimpleNamespace(params={"lm_head.weight": 0, "model.norm.weight": 0}, aliases={},
                             buffers={})  # fmt: skip
    files = {"model.embed_tokens.weight": Path("a"), "model.norm.weight": Path("a")}
    assert _sources(layout, files, _tied_sources(last)) == (
        {"lm_head.weight": "model.embed_tokens.weight", "model.norm.weight": "model.norm.weight"},
        [],
    )
    assert _sources(layout, files, {})[1] == ["lm_head.weight"]
    both = {**files, "lm_head.weight": Path("b")}  # the file's own head wins
    assert _sources(layout, both, _tied_sources(last))[0]["lm_head.weight"] == "lm_head.weight"


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
        ("llama", ["--parallelism.tp", "3", "--nproc", "6", "--data.seq_len", "48"],
         "over parallel.tp=3: num_attention_heads=4, num_key_value_heads=2, intermediate_size=64"),
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
        "llama": _llama_config(),
    }
    configs[kind].save_pretrained(tmp_path / kind)
    args = [*PP, "--model.hf", str(tmp_path / kind), *NO_CKPT, *extra]
    assert main([*args, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
