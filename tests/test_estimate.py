"""``flatshard estimate``: validated against flatshard's measured memory, and the published
ZeRO arithmetic (16 bytes per parameter, divided by the data-parallel degree under ZeRO-3)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from flatshard.tools.estimate import (
    Layout,
    ModelSpec,
    Precision,
    Workload,
    activations,
    estimate_memory,
    estimate_time,
    main,
)
from flatshard.tools.estimate.cli import min_world
from flatshard.tools.estimate.devices import DEVICES

GIB = 2**30
LLAMA_70B = dict(layers=80, hidden=8192, heads=64, kv_heads=8, vocab=128256, params=70e9)

# ---- against measurement (world 2, Gloo, CPU) -------------------------------------------------


def case_measure(model: str, batch: int, seq: int, kw: dict) -> dict[str, int]:
    from flatshard.tools.estimate.measure import measure_step

    return measure_step(model, batch=batch, seq=seq, **kw)


MEASURED = [  # (id, model, batch, seq, measure_step options): each peaks somewhere else
    ("mlp-backward", "tiny", 4, 128, {}),
    ("shard-grad-op", "tiny", 4, 128, {"strategy": "shard_grad_op"}),
    ("reduce", "small", 2, 128, {}),
    ("act-ckpt", "small", 2, 128, {"act_ckpt": True}),
    ("no-shard", "tiny", 4, 128, {"strategy": "no_shard"}),
    ("prefetch-2-post", "tiny", 4, 128, {"prefetch": (2, "post")}),
    ("bf16", "small", 2, 128, {"precision": "bf16"}),
    ("bf16-reduce-fp32", "small", 2, 128, {"precision": "bf16", "reduce": "fp32"}),
    # fs.shard(coalesce=False, split_root=False): one collective per unit, the root whole and
    # kept gathered from forward into backward, the last block too.
    ("uncoalesced-unsplit", "tiny", 4, 128, {"coalesce": False, "split_root": False}),
    # 24 tiny blocks: three buckets (9, 9, 6 blocks); the storages released in forward stay in
    # the engine's StorageCache while the next buckets are gathered.
    ("three-buckets", "tiny", 2, 32, {"layers": 24}),
]


SLOW_MEASURED = {"bf16", "bf16-reduce-fp32"}  # ~14 s each: .ci/run's slow pass runs them


@pytest.mark.parametrize(
    "model, batch, seq, kw",
    [
        pytest.param(*c[1:], id=c[0], marks=[pytest.mark.slow] if c[0] in SLOW_MEASURED else [])
        for c in MEASURED
    ],
)
def test_estimate_matches_measured_memory(dist_pools, model, batch, seq, kw):
    measured = dist_pools(2).run(case_measure, model, batch, seq, kw)[0]  # rank 0
    forward, backward = kw.get("prefetch", (1, "pre"))
    precision = Precision(kw.get("precision", "fp32"), kw.get("reduce"))
    layout = Layout(
        2,
        kw.get("strategy", "full_shard"),
        precision=precision,
        backend="gloo",
        optimizer_impl="forloop",  # torch.optim's default on CPU
        prefetch_forward=forward,
        prefetch_backward=backward,
        coalesce=kw.get("coalesce", True),
        split_root=kw.get("split_root", True),
    )
    work = Workload(batch, seq, act_ckpt=kw.get("act_ckpt", False), fused_norm=False)
    spec = ModelSpec.from_preset(model)
    spec = dataclasses.replace(spec, layers=kw.get("layers", spec.layers))
    est = estimate_memory(spec, layout, work)
    for key in ("parameters", "gradients", "optimizer", "buffers", "gathered_peak"):
        assert getattr(est, key) == measured[key], key  # exact, padding included
    for key in ("activations", "peak"):
        assert getattr(est, key) == pytest.approx(measured[key], rel=0.05), key


# ---- ZeRO arithmetic -------------------------------------------------------------------------


def _states(spec: ModelSpec, world: int, strategy: str, precision: str = "fp32") -> int:
    layout = Layout(world, strategy, precision=Precision(precision))
    return estimate_memory(spec, layout, Workload(1, 4096)).model_states


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("world", [8, 64, 1000])
def test_full_shard_model_states_are_16_psi_over_nd(precision, world):
    spec = ModelSpec.from_sizes(**LLAMA_70B)
    psi = spec.params
    slack = 16 * world * (1 + spec.layers) + 4 * 729  # padding + AdamW step tensors
    got = _states(spec, world, "full_shard", precision)
    assert 16 * psi / world <= got <= 16 * psi / world + slack
    assert _states(spec, world, "no_shard", precision) == pytest.approx(16 * psi, rel=1e-6)


def test_zero_paper_7_5b_on_64_gpus():
    """ZeRO (Rajbhandari et al. 2020), Fig. 1: Ψ = 7.5B, Nd = 64: 120 GB baseline, 1.9 GB ZeRO-3."""
    spec = ModelSpec.from_sizes(layers=32, hidden=4096, heads=32, vocab=50304, params=7.5e9)
    assert _states(spec, 64, "no_shard") / 1e9 == pytest.approx(120, rel=0.01)
    assert _states(spec, 64, "full_shard") / 1e9 == pytest.approx(1.875, rel=0.01)


def test_70b_needs_zero3_on_80gb_cards():
    spec = ModelSpec.from_sizes(**LLAMA_70B)
    work = Workload(1, 4096, act_ckpt=True, fused_norm=True)
    bf16 = Precision("bf16")
    cap = DEVICES["h100"].memory_gib * GIB

    def peak(world: int, strategy: str) -> int:
        return estimate_memory(spec, Layout(world, strategy, precision=bf16), work).peak

    assert _states(spec, 8, "no_shard", "bf16") / 1e12 == pytest.approx(1.12, rel=0.01)
    assert peak(8, "no_shard") > cap  # DDP: 1.12 TB per rank
    assert _states(spec, 8, "full_shard", "bf16") / 1e9 == pytest.approx(140, rel=0.01)
    assert peak(8, "full_shard") > cap  # one node of 8 is not enough even fully sharded
    assert peak(64, "full_shard") < cap
    assert peak(64, "shard_grad_op") > cap  # keeps 140 GB of bf16 parameters gathered
    assert min_world(spec, Layout(8, "full_shard", precision=bf16), work, cap) == 32


# ---- formulas ----------------------------------------------------------------------------------


def test_block_activations_are_korthikanti_without_dropout():
    """Korthikanti et al. 2022, eq. 1: ``s b h (34 + 5 a s / h)`` bytes per GPT-3 layer (16-bit,
    LayerNorm, GELU 4h MLP, softmax attention, dropout). Without dropout the three masks and the
    dropout output go: ``32 s b h + 2 a s^2 b``; we also count fp32 mean/rstd and log-sum-exp."""
    b, s, h, a = 2, 2048, 4096, 32
    spec = ModelSpec("gpt3-like", 1, h, a, a, 50257, 4 * h, mlp="gelu", norm="layernorm")
    lay = Layout(8, precision=Precision("bf16"))
    math = activations(spec, lay, Workload(b, s, attention="math")).block
    rope = 2 * s * (h // a) * 2  # our blocks use RoPE: bf16 copies of cos/sin for q and k
    assert math == s * b * h * 32 + 2 * a * s * s * b + 4 * s * b * (a + 4) + rope
    flash = activations(spec, lay, Workload(b, s, attention="flash")).block
    assert flash == math - 2 * a * s * s * b  # flash attention stores no T x T matrix


def test_activations_scale_and_checkpointing():
    spec, lay = ModelSpec.from_preset("small"), Layout(2)
    one, two = activations(spec, lay, Workload(1, 256)), activations(spec, lay, Workload(2, 256))
    assert two.block == 2 * one.block and two.head == 2 * one.head
    ckpt = estimate_memory(spec, lay, Workload(2, 256, act_ckpt=True))
    assert ckpt.activations == spec.layers * two.block_input + two.head + two.fixed
    full = estimate_memory(spec, lay, Workload(2, 256))
    assert ckpt.peak < full.peak


def test_step_time_volumes_follow_the_strategy():
    spec = ModelSpec.from_sizes(**LLAMA_70B)
    work, dev = Workload(1, 4096), DEVICES["h100"]
    times = {
        s: estimate_time(spec, Layout(64, s, precision=Precision("bf16")), work, dev)
        for s in ("full_shard", "shard_grad_op", "no_shard")
    }
    f = 63 / 64
    # The root (the embedding: an untied head is in its tail) and the tail are gathered once;
    # every block twice, the last one too (the tail starts the backward, see schedule.py).
    once = spec.root_params
    assert times["full_shard"].all_gather_bytes == pytest.approx(
        (2 * spec.params - once) * 2 * f, rel=1e-4
    )
    assert times["shard_grad_op"].all_gather_bytes == pytest.approx(spec.params * 2 * f, rel=1e-4)
    # bf16 mixed precision reduces in bf16 unless told otherwise (flatshard's default)
    assert times["full_shard"].reduce_scatter_bytes == pytest.approx(spec.params * 2 * f, rel=1e-4)
    assert times["no_shard"].all_reduce_bytes == pytest.approx(2 * spec.params * 2 * f, rel=1e-4)
    for t in times.values():
        assert t.step_s >= max(t.compute_s, t.exposed_comm_s)


# ---- specs and CLI -----------------------------------------------------------------------------


def test_preset_spec_matches_the_model_config():
    from flatshard.models import GPTConfig

    for name in ("tiny", "small", "medium", "large", "1b"):
        cfg = GPTConfig.preset(name)
        spec = ModelSpec.from_preset(name)
        assert spec.params == cfg.num_params()
        assert spec.flops_per_token(512) == cfg.flops_per_token(512)


def test_bad_inputs_name_the_option():
    with pytest.raises(ValueError, match="--params"):
        ModelSpec.from_sizes(layers=2, hidden=64, heads=4, vocab=100, ffn=128, params=1e9)
    with pytest.raises(ValueError, match="shard_size=3"):
        Layout(8, "hybrid_shard", shard_size=3)
    with pytest.raises(ValueError, match="strategy"):
        Layout(8, "zero4")


def test_cli_table_and_json(tmp_path, capsys):
    out = tmp_path / "e.json"
    argv = ["--model", "tiny", "--world", "2", "--gpu", "cpu", "--batch", "4", "--seq", "128"]
    assert main([*argv, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    est = estimate_memory(
        ModelSpec.from_preset("tiny"), Layout(2, backend="gloo"), Workload(4, 128)
    )
    assert f"peak (at {est.peak_phase})" in table and f"{est.peak / 2**20:.2f}" in table
    assert "1 bucket(s) of 4 blocks, root + tail" in table  # fs.shard's defaults
    data = json.loads(out.read_text())
    assert data["memory_bytes"]["peak"] == est.peak
    assert data["layout"]["backend"] == "gloo" and data["fits"] is None
    with pytest.raises(SystemExit):
        main(["--layers", "4"])
    assert "missing --hidden" in capsys.readouterr().err


def test_hybrid_shard_is_full_shard_within_the_group():
    spec, work = ModelSpec.from_preset("1b"), Workload(1, 2048, fused_norm=True)
    hybrid = estimate_memory(spec, Layout(64, "hybrid_shard", shard_size=8), work)
    full8 = estimate_memory(spec, Layout(8, "full_shard"), work)
    assert dataclasses.replace(hybrid, phases=()) == dataclasses.replace(full8, phases=())
