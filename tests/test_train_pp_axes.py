"""``flatshard train --parallelism.pp 2`` with the other axes: tp, hybrid_shard, ep.

Each combination runs the same model on the same global batch (same seed and data order, fp32,
no dropout) as its 1-D run, plain data parallel without a pipeline, and must equal it step for
step: losses, gradient norms, validation losses, tokens and the final text sample.

* **pp x tp** (world 4 = pp 2 x dp 1 x tp 2, mesh ``("pp", "dp", "tp")``), with the head tied
  to the embedding: the last stage's copy of the matrix is tensor-parallel like the embedding
  (``Shard(0)``) and ``fs.tie_across_stages`` sums the two copies' gradients per tp rank. A
  trains 3 steps and checkpoints at step 2; B is the world-1 run (one tied parameter). The
  checkpoints are topology-free: D resumes A's step-2 checkpoint at world 1 (no pp, no tp), E
  resumes B's under pp 2 x tp 2; both continue B's curve. The other combinations keep the
  head untied (the tie's other paths: tests/test_train_pp.py).
* **pp x dp x tp** (world 8 = pp 2 x dp 2 x tp 2): the 1-D run is dp 2 at world 2.
* **pp x hybrid_shard** (world 4 = pp 2 x replicate 2 x shard 1, mesh ``("pp", "replicate",
  "shard")``): four workers started as four one-worker machines (torchrun's variables set by
  hand, ``LOCAL_WORLD_SIZE=1``), so each stage's two dp ranks replicate across machines; the
  1-D run is dp 2 at world 2.
* **pp x ep** (world 4 = pp 2 x dp 2, each stage's dp ranks one ep group of 2: the MoE GPT
  with 4 experts, 2 per rank): the pipeline microbatches are the 1-D run's micro-batches (one
  row each), so the routers' load-balancing loss, which each stage adds to its gradient, sees
  the same tokens; the 1-D run is dp 2 at world 2 with every expert on every rank. Q resumes
  the pp x ep run's step-2 checkpoint at world 2 without pp or ep and continues the curve.

The other tests run in this process: MoE stages' load-balancing gradient against the
whole MoE GPT, the hybrid shard size, and the refusals.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flatshard.tools.train.cli import main
from flatshard.tools.train.pipeline_build import hybrid_shard_degree
from flatshard.tools.train.pipeline_stage import GPTStage, layer_split

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from fault_common import (  # tiny config, corpus
    assert_same_curve,
    clean_env,
    metrics,
    run_train,
    write_inputs,
)

RUN = [
    "--model.dropout", "0",  # dropout masks depend on the rank layout: off for parity
    "--model.n_layers", "4",
    "--model.tie_embeddings", "false",
    "--data.rows", "4",  # 4 pipeline microbatches of one row
    "--optim.decay_steps", "6",
    "--log.every", "1", "--log.val_every", "2", "--log.sample_tokens", "6",
    "--log.plot_every", "0", "--steps", "3",
]  # fmt: skip
CKPT = ["--checkpoint.every", "2", "--checkpoint.enabled", "true"]
NO_CKPT = ["--checkpoint.enabled", "false"]
PP_TP = ["--nproc", "4", "--parallelism.pp", "2", "--parallelism.tp", "2"]


def _train(*args: str) -> subprocess.CompletedProcess:
    proc = run_train(list(args), timeout=900)  # world 8 on the shared 2-core box is slow
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _as_machines(world: int, per_machine: int, args: list[str]) -> subprocess.CompletedProcess:
    """``world`` workers started as machines of ``per_machine`` each, the way torchrun on each
    machine would start them (its variables set by hand); rank 0's output."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "flatshard.tools.cli", "train", *args]
    procs = []
    for rank in range(world):
        env = clean_env() | {
            "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_machine),
            "LOCAL_WORLD_SIZE": str(per_machine), "GROUP_RANK": str(rank // per_machine),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        }  # fmt: skip
        out = subprocess.PIPE if rank == 0 else subprocess.DEVNULL
        procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, text=True, env=env))
    outputs = [p.communicate(timeout=400) for p in procs]
    for rank, (p, (_, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, (rank, err[-3000:])
    return subprocess.CompletedProcess(cmd, 0, outputs[0][0], outputs[0][1])


def _resume_from(root: Path, source: str, target: str, *args: str) -> subprocess.CompletedProcess:
    shutil.copytree(root / source / "checkpoints" / "step_000002",
                    root / target / "checkpoints" / "step_000002")  # fmt: skip
    return _train(*args, *CKPT, "--resume", "--out", str(root / target))


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("train_pp_tp")
    base = [*write_inputs(root), *RUN, "--model.tie_embeddings", "true"]  # the last one wins
    done = {
        "a": _train(*base, *PP_TP, *CKPT, "--out", str(root / "a")),
        "b": _train(*base, "--nproc", "1", *CKPT, "--out", str(root / "b")),
    }
    done["d"] = _resume_from(root, "a", "d", *base, "--nproc", "1")
    done["e"] = _resume_from(root, "b", "e", *base, *PP_TP)
    return {name: (proc.stdout, metrics(root / name)) for name, proc in done.items()}


@pytest.fixture(scope="module")
def world8_runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("train_pp_dp_tp")
    base = [*write_inputs(root), *RUN, *NO_CKPT]
    pp_dp_tp = ["--nproc", "8", "--parallelism.pp", "2", "--parallelism.tp", "2"]
    done = {
        "t": _train(*base, *pp_dp_tp, "--out", str(root / "t")),
        "r": _train(*base, "--nproc", "2", "--out", str(root / "r")),
    }
    return {name: (proc.stdout, metrics(root / name)) for name, proc in done.items()}


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("train_pp_ep")
    moe = ["--model.experts", "4", "--model.top_k", "2", "--data.rows", "1",
           "--data.micro_batches", "4"]  # fmt: skip
    base = [*write_inputs(root), *RUN, *moe]
    pp_ep = ["--nproc", "4", "--parallelism.pp", "2", "--parallelism.ep", "2"]
    done = {
        "p": _train(*base, *pp_ep, *CKPT, "--out", str(root / "p")),
        "r": _train(*base, "--nproc", "2", *NO_CKPT, "--out", str(root / "r")),
    }
    done["q"] = _resume_from(root, "p", "q", *base, "--nproc", "2")
    return {name: (proc.stdout, metrics(root / name)) for name, proc in done.items()}


@pytest.fixture(scope="module")
def hybrid_runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("train_pp_hybrid")
    base = [*write_inputs(root), *RUN, *NO_CKPT]
    # the one trainer run that releases and regathers per microbatch (the others keep the
    # stages gathered, the default): both ways must equal the 1-D run
    hybrid = ["--parallelism.pp", "2", "--parallel.strategy", "hybrid_shard",
              "--parallelism.pp_keep_gathered", "false"]  # fmt: skip
    done = {
        "h": _as_machines(4, 1, [*base, *hybrid, "--out", str(root / "h")]),
        "r": _train(*base, "--nproc", "2", "--out", str(root / "r")),
    }
    return {name: (proc.stdout, metrics(root / name)) for name, proc in done.items()}


def _sample(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("sample: "))


@pytest.mark.slow  # four launches of 1-4 CPU workers (~2 min on the shared 2-core box)
def test_pp_x_tp_equals_the_1d_run_step_for_step(tp_runs):
    out, rows = tp_runs["a"]
    assert "4 rank(s) (pp 2 x dp 1 x tp 2, 1F1B, 4 microbatches)" in out
    assert_same_curve(rows, tp_runs["b"][1])
    assert rows[-1]["loss"] < rows[0]["loss"]  # it learns
    assert _sample(out) == _sample(tp_runs["b"][0])  # the padded context, the last stage


@pytest.mark.slow
@pytest.mark.parametrize("name", ["d", "e"])
def test_pp_x_tp_checkpoints_resume_in_another_layout(tp_runs, name):
    """D: A's pp 2 x tp 2 checkpoint continued at world 1; E: B's continued at pp 2 x tp 2."""
    out, rows = tp_runs[name]
    assert "resumed from" in out and "step_000002" in out
    step3 = [r for r in rows if r["step"] == 3]
    assert_same_curve(step3, tp_runs["b"][1][2:])


@pytest.mark.slow  # eight CPU workers, then two: several minutes on the shared 2-core box
def test_pp_x_dp_x_tp_at_world_8_equals_the_1d_run_step_for_step(world8_runs):
    out, rows = world8_runs["t"]
    assert "8 rank(s) (pp 2 x dp 2 x tp 2, 1F1B, 4 microbatches)" in out
    assert_same_curve(rows, world8_runs["r"][1])
    assert _sample(out) == _sample(world8_runs["r"][0])


@pytest.mark.slow  # two launches (four one-worker machines, and world 2): ~40 s
def test_pp_x_hybrid_shard_equals_the_1d_run_step_for_step(hybrid_runs):
    out, rows = hybrid_runs["h"]
    assert "4 rank(s) (pp 2 x dp 2, 1F1B, 4 microbatches)" in out and "hybrid_shard" in out
    assert_same_curve(rows, hybrid_runs["r"][1])
    assert _sample(out) == _sample(hybrid_runs["r"][0])


@pytest.mark.slow  # three launches (world 4, 2, 2): ~2-3 min
def test_pp_x_ep_equals_the_1d_run_step_for_step(ep_runs):
    out, rows = ep_runs["p"]
    assert (
        "(pp 2 x dp 2, 1F1B, 4 microbatches)" in out and "MoE GPT (4 experts, top-2, ep 2)" in out
    )
    assert_same_curve(rows, ep_runs["r"][1])
    assert _sample(out) == _sample(ep_runs["r"][0])


@pytest.mark.slow
def test_a_pp_x_ep_checkpoint_resumes_without_pp_or_ep(ep_runs):
    out, rows = ep_runs["q"]
    assert "resumed from" in out and "step_000002" in out
    assert_same_curve([r for r in rows if r["step"] == 3], ep_runs["r"][1][2:])


def test_moe_stages_add_their_routers_loss_to_the_gradient():
    """Two MoE stages chained (the load-balancing share attached to each stage's output) give
    the whole MoE GPT's gradient of ``loss + aux_loss_coef * aux_loss``, routers included."""
    from flatshard.models.moe import MoEConfig, MoEGPT

    torch.manual_seed(0)
    config = MoEConfig(vocab_size=32, d_model=16, n_layers=4, n_heads=2, max_seq_len=16,
                       tie_embeddings=False, n_experts=4, top_k=2, aux_loss_coef=0.5)  # fmt: skip
    model = MoEGPT(config)
    ids = torch.randint(32, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    (model(ids, positions).square().mean() + config.aux_loss_coef * model.aux_loss).backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    split = layer_split(4, 2)
    stages = [GPTStage(model, split[s], first=s == 0, last=s == 1) for s in range(2)]
    for stage in stages:
        stage.aux_scale = config.aux_loss_coef / config.n_layers  # one microbatch
    stages[1](stages[0](ids, positions), positions).square().mean().backward()
    got = {name: p.grad for stage in stages for name, p in stage.named_parameters()}
    assert sorted(got) == sorted(want) and "layers.0.moe.router.gate.weight" in got
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize(
    ("world", "per_machine", "pp", "tp", "shard"),
    [(4, 1, 2, 1, 1), (8, 2, 2, 1, 2), (8, 4, 2, 1, 4), (8, 8, 2, 1, 4), (16, 4, 2, 2, 2)],
)
def test_hybrid_shard_size_is_a_stages_dp_ranks_on_one_machine(world, per_machine, pp, tp, shard):
    assert hybrid_shard_degree(world, per_machine, pp, tp) == shard


def test_a_hybrid_layout_that_does_not_fit_the_machines_is_refused():
    with pytest.raises(ValueError, match=r"hybrid_shard.*parallel\.pp=2.*use full_shard"):
        hybrid_shard_degree(12, 8, 2, 1)  # 6 dp ranks per stage, 8 workers per machine


PP = ["--nproc", "4", "--parallelism.pp", "2", "--checkpoint.enabled", "false"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([*PP, "--parallelism.tp", "2", "--parallelism.loss_parallel", "true"],
         "parallel.loss_parallel=true cannot be"),
        (["--nproc", "4", "--parallelism.pp", "4", "--parallelism.tp", "2"],
         "parallel.tp=2 does not divide"),
        ([*PP, "--model.experts", "4", "--parallelism.ep", "4"],
         "parallel.ep=4 must divide the 2 ranks of each stage"),
    ],
)  # fmt: skip
def test_unusable_combinations_are_refused_before_any_worker_starts(
    args, message, tmp_path, monkeypatch, capsys
):
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    assert main([*args, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
