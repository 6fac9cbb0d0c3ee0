"""``flatshard estimate`` with tensor parallelism (torchtitan's Llama plan) composed with
flatshard's data-parallel sharding: every expectation follows from the formulas of
``tools/estimate/tp_cost.py`` (its Note), none is a recorded output."""

from __future__ import annotations

import dataclasses
import json

import pytest

from flatshard.tools.estimate import (
    DEVICES,
    Layout,
    ModelSpec,
    Precision,
    Workload,
    activations,
    estimate_memory,
    estimate_time,
    main,
)
from flatshard.tools.estimate.efficiency import gemm_slowdown, step_flops
from flatshard.tools.estimate.tp_cost import local_spec, tp_traffic
from flatshard.tools.estimate.units import plan_units

GIB = 2**30
BF16 = Precision("bf16")
# Llama 3.1 70B (torchtitan's "70B" flavour: ffn 28672, untied 128256-token vocabulary).
LLAMA3_70B = ModelSpec("llama3-70b", 80, 8192, 64, 8, 128256, 28672, max_seq=8192)
# Small enough that no unit is padded under no_shard (every size a multiple of 4 elements).
SMALL = ModelSpec("small-tp", 2, 64, 4, 4, 256, 128)


def _replicated(spec: ModelSpec) -> int:
    """Parameters that TP leaves whole on every GPU: the norm weights (two per block, the
    final one); everything else (block matrices, embedding, head) is split over tp."""
    return 2 * spec.hidden * spec.layers + spec.hidden


# ---- tp = 1 is the data-parallel estimate -----------------------------------------------------


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op", "no_shard", "hybrid_shard"])
@pytest.mark.parametrize("ckpt", [False, True])
def test_tp1_is_the_data_parallel_estimate(strategy, ckpt):
    spec, work = ModelSpec.from_preset("1b"), Workload(2, 512, act_ckpt=ckpt, fused_norm=True)
    plain = Layout(16, strategy, precision=BF16)
    assert local_spec(spec, 1) is spec
    lay = dataclasses.replace(plain, tp=1, sequence_parallel=False)  # no effect at tp 1
    assert estimate_memory(spec, lay, work) == estimate_memory(spec, plain, work)
    t = estimate_time(spec, lay, work, DEVICES["h100"])
    assert t == estimate_time(spec, plain, work, DEVICES["h100"])
    assert t.tp_comm_s == 0 and t.step_s == t.compute_s + t.exposed_comm_s
    assert tp_traffic(spec, plain, work).bus_bytes == 0


# ---- memory ----------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_divides_the_split_parameters_only(tp):
    """no_shard (no padding here): params, grads and AdamW state are (replicated + split/tp)."""
    spec, work = SMALL, Workload(1, 64)
    rep = _replicated(spec)
    per_gpu = rep + (spec.params - rep) // tp
    tensors = spec.root_tensors + spec.layers * spec.block_tensors
    est = estimate_memory(spec, Layout(1, "no_shard", tp=tp), work)
    assert est.parameters == est.gradients == 4 * per_gpu
    assert est.optimizer == 8 * per_gpu + 4 * tensors  # m, v and a 4-byte step per tensor
    one = estimate_memory(spec, Layout(1, "no_shard"), work)
    assert est.parameters < one.parameters / tp + 4 * rep  # only the norms stay whole


@pytest.mark.parametrize("world", [8, 64])
def test_tp_then_dp_sharding_of_llama_70b(world):
    """full_shard: 16 bytes per parameter over (tp x world) GPUs, the norms over world only."""
    spec, tp = LLAMA3_70B, 8
    est = estimate_memory(spec, Layout(world, tp=tp, precision=BF16), Workload(1, 8192))
    rep = _replicated(spec)
    ideal = 16 * ((spec.params - rep) / (tp * world) + rep / world)
    slack = 16 * world * (3 + spec.layers) + 4 * 729  # padding + AdamW step tensors
    assert ideal <= est.model_states <= ideal + slack


def test_gathered_units_are_a_tp_share_of_the_block():
    spec, tp = LLAMA3_70B, 8
    full = plan_units(spec, Layout(32, precision=BF16))
    split = plan_units(spec, Layout(32, tp=tp, precision=BF16))
    norms = 2 * spec.hidden
    assert split.block.numel == norms + (full.block.numel - norms) // tp
    assert split.root.numel == spec.hidden * (spec.vocab // tp)  # the embedding's rows
    assert not split.pooled  # TP units gather into buffers of their own (core/state.py)
    assert full.lazy_root and not split.lazy_root  # root_split.worth_lazy: never with DTensors


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_backward_holds_a_tp_share_of_the_gradients(tp):
    """In each block's post-backward the per-parameter gradients held are the head's and the
    final norm's (waiting for the tail's reduction) and the block's: 1/tp of their matrices."""
    spec = SMALL
    est = estimate_memory(spec, Layout(1, "no_shard", tp=tp), Workload(1, 64))
    block = 2 * spec.hidden + (spec.block_params - 2 * spec.hidden) // tp
    held = spec.vocab // tp * spec.hidden + spec.hidden
    ends = [p for p in est.phases if p.name.startswith("backward block") and "end" in p.name]
    assert len(ends) == spec.layers
    for phase in ends:
        assert phase.parts["unit_grads"] == 4 * (held + block), phase.name


def _llama_block(tp: int, sp: bool, b: int = 2, s: int = 2048) -> tuple[int, int]:
    """GPT-3-like block (LayerNorm, GELU 4h, math attention, bf16): its activations, and the
    checkpointed block's input."""
    h, a = 4096, 32
    spec = ModelSpec("gpt3-like", 1, h, a, a, 50304, 4 * h, mlp="gelu", norm="layernorm")
    lay = Layout(8, precision=BF16, tp=tp, sequence_parallel=sp)
    act = activations(spec, lay, Workload(b, s, attention="math"))
    return act.block, act.block_input


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_block_activations_with_and_without_sequence_parallelism(tp):
    """Korthikanti et al. 2022 without dropout, per GPU: norms keep input + output (2+2 bytes
    each), attention q, k, v, out (8/t), the MLP up and gelu(up) (16/t), softmax 2as/t; fp32:
    LayerNorm mean + rstd, one log-sum-exp per head (4a/t). With sequence parallelism the norm
    input and statistics are 1/t, the all-gathered norm output (saved by the colwise matmuls)
    whole; Megatron-LM re-gathers it, hence its 34/t where this is 28/t + 4."""
    b, s, h, a = 2, 2048, 4096, 32
    rope = 2 * s * (h // a) * 2
    softmax = 2 * a * s * s * b // tp
    sp, sp_input = _llama_block(tp, True)
    assert sp == s * b * h * 28 // tp + 4 * s * b * h + 4 * s * b * (a + 4) // tp + softmax + rope
    assert sp_input == s * b * h * 2 // tp  # a checkpointed block keeps its sequence shard
    no_sp, no_sp_input = _llama_block(tp, False)
    assert no_sp == s * b * h * (8 + 24 // tp) + 4 * s * b * (a // tp + 4) + softmax + rope
    assert no_sp_input == s * b * h * 2


@pytest.mark.parametrize("sp", [True, False])
def test_sequence_parallel_transients(sp):
    """The gradient between blocks is a sequence shard with SP; at a block's last matmul its
    output is whole (the reduce-scatter's input) and the block's output a shard."""
    spec, tp, work = SMALL, 4, Workload(2, 64)
    n, c = work.tokens, spec.hidden
    lay = Layout(2, tp=tp, sequence_parallel=sp)
    shard = n // tp if sp else n
    assert activations(spec, lay, work).grad_input == shard * c * 4
    est = estimate_memory(spec, lay, work)
    forward = next(p for p in est.phases if p.name == "forward block 0")
    assert forward.parts["workspace"] == (n + shard) * c * 4


# ---- traffic and time ------------------------------------------------------------------------


@pytest.mark.parametrize("ckpt", [False, True])
def test_tp_collectives_per_step(ckpt):
    """Sequence parallel: per block and pass two all-gathers and two reduce-scatters of a
    [b, s, h] activation (forward, backward, and the recomputed forward with checkpointing),
    plus the embedding's and the head's; without: one all-reduce for each pair."""
    spec, tp, b, s = LLAMA3_70B, 8, 2, 4096
    work = Workload(b, s, act_ckpt=ckpt)
    count = spec.layers * 2 * (3 if ckpt else 2) + 2
    bus = count * b * s * spec.hidden * 2 * (tp - 1) / tp  # bf16
    sp = tp_traffic(spec, Layout(32, tp=tp, precision=BF16), work)
    assert sp.all_gathers == sp.reduce_scatters == count and sp.all_reduces == 0
    assert sp.all_gather_bytes == sp.reduce_scatter_bytes == pytest.approx(bus)
    no_sp = tp_traffic(spec, Layout(32, tp=tp, precision=BF16, sequence_parallel=False), work)
    assert no_sp.all_reduces == count and no_sp.all_gathers == 0
    assert no_sp.bus_bytes == pytest.approx(sp.bus_bytes)  # all-reduce = AG + RS


def test_tp_traffic_scales_with_batch_and_sequence_not_with_dp():
    spec = LLAMA3_70B

    def bus(world: int, b: int, s: int, tp: int = 8) -> float:
        return tp_traffic(spec, Layout(world, tp=tp, precision=BF16), Workload(b, s)).bus_bytes

    assert bus(32, 2, 4096) == pytest.approx(2 * bus(32, 1, 4096))
    assert bus(32, 1, 8192) == pytest.approx(2 * bus(32, 1, 4096))
    assert bus(64, 1, 4096) == bus(32, 1, 4096)
    assert bus(32, 1, 4096, tp=2) == pytest.approx(bus(32, 1, 4096, tp=8) * (1 / 2) / (7 / 8))


def test_dp_collectives_carry_a_tp_share_of_the_parameters():
    spec, world, tp = LLAMA3_70B, 32, 8
    lay = Layout(world, tp=tp, precision=Precision("bf16", "fp32"))
    t = estimate_time(spec, lay, Workload(1, 8192, act_ckpt=True), DEVICES["h100"])
    rep = _replicated(spec)
    per_gpu = rep + (spec.params - rep) / tp
    # every unit reduced once in fp32 over the dp group
    assert t.reduce_scatter_bytes == pytest.approx(per_gpu * 4 * (world - 1) / world, rel=1e-4)


def test_step_time_adds_tp_communication_on_the_critical_path():
    spec, dev, work = LLAMA3_70B, DEVICES["h100"], Workload(4, 8192, act_ckpt=True)
    one = estimate_time(spec, Layout(8, precision=BF16), work, dev)
    lay = Layout(8, tp=8, precision=BF16)
    t = estimate_time(spec, lay, work, dev)
    assert t.flops == pytest.approx(one.flops / 8)  # the micro-batch shared by 8 GPUs
    # ... and its 8-times narrower wk/wv (128 columns) are memory-bound on an H100
    # (efficiency.gemm_slowdown, checked by hand in test_estimate_published.py)
    assert gemm_slowdown(spec, Layout(8, precision=BF16), work, dev) == 1
    share = gemm_slowdown(spec, lay, work, dev)
    f = step_flops(spec, lay, work)
    expected = one.compute_s / 8 + f.linear * (share - 1) / (989e12 * dev.mfu)
    assert t.compute_s == pytest.approx(expected)
    tp_bytes = t.tp_all_gather_bytes + t.tp_reduce_scatter_bytes
    assert t.tp_comm_s == pytest.approx(tp_bytes / (dev.intra_gbps * 1e9))  # tp within a node
    assert t.step_s == pytest.approx(t.compute_s + t.exposed_comm_s + t.tp_comm_s)
    assert t.tokens_per_s == pytest.approx(work.tokens / t.step_s / 8)  # per GPU
    # the dp group of a tp-8 layout spans 8 nodes: inter-node bandwidth
    assert t.comm_s == pytest.approx(
        (t.all_gather_bytes + t.reduce_scatter_bytes) / (dev.inter_gbps * 1e9)
    )


def test_tp_beyond_a_node_uses_the_inter_node_bandwidth():
    dev = dataclasses.replace(DEVICES["h100"], per_node=4)
    work, lay = Workload(1, 8192), Layout(4, tp=8, precision=BF16)
    t = estimate_time(LLAMA3_70B, lay, work, dev)
    tp_bytes = tp_traffic(LLAMA3_70B, lay, work).bus_bytes
    assert t.tp_comm_s == pytest.approx(tp_bytes / (dev.inter_gbps * 1e9))


@pytest.mark.parametrize("tp, link", [(4, "intra_gbps"), (8, "inter_gbps")])
def test_dp_groups_stride_over_tp_groups(tp, link):
    """GPUs are numbered tp-innermost: two data-parallel replicas of tp GPUs share one node of
    8 only while 2 x tp <= 8 (no_shard: the gradient all-reduce over them)."""
    dev = DEVICES["h100"]
    t = estimate_time(LLAMA3_70B, Layout(2, "no_shard", tp=tp), Workload(1, 8192), dev)
    assert t.all_reduce_bytes > 0
    assert t.comm_s == pytest.approx(t.all_reduce_bytes / (getattr(dev, link) * 1e9))


# ---- 3-D and the published torchtitan run -----------------------------------------------------


def test_hybrid_shard_times_tp_is_full_shard_within_the_group():
    spec, work = LLAMA3_70B, Workload(1, 8192, act_ckpt=True, fused_norm=True)
    hybrid = estimate_memory(spec, Layout(32, "hybrid_shard", shard_size=8, tp=8), work)
    full8 = estimate_memory(spec, Layout(8, "full_shard", tp=8), work)
    assert dataclasses.replace(hybrid, phases=()) == dataclasses.replace(full8, phases=())


def test_torchtitan_70b_fsdp32_tp8_fits_as_published():
    """torchtitan (benchmarks/llama3_h100_202412_torchtitan.md, Table 4) trained this on 96 GB
    H100s with 71.9 GiB peak *reserved* memory: the live tensors cannot exceed it. Model
    states are ZeRO's 16 bytes per parameter over all 256 GPUs, as for FSDP alone."""
    work = Workload(16, 8192, act_ckpt=True, fused_norm=True)
    lay = Layout(32, tp=8, precision=Precision("bf16", "fp32"))
    est = estimate_memory(LLAMA3_70B, lay, work)
    assert est.peak <= 71.9 * GIB
    assert est.model_states == pytest.approx(16 * LLAMA3_70B.params / 256, rel=0.01)


# ---- errors and the CLI ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, tp, match",
    [
        (ModelSpec("x", 2, 960, 30, 10, 100, 512), 8, "heads=30 is not divisible by --tp 8"),
        (ModelSpec("x", 2, 1024, 32, 4, 100, 512), 8, "kv_heads=4 .* --tp 8"),
        (ModelSpec("x", 2, 1024, 32, 8, 100, 500), 8, "ffn=500 .* give --ffn a multiple of 8"),
    ],
)
def test_indivisible_sizes_name_the_value_and_the_fix(spec, tp, match):
    with pytest.raises(ValueError, match=match):
        estimate_memory(spec, Layout(8, tp=tp), Workload(1, 64))
    with pytest.raises(ValueError, match=match):
        estimate_time(spec, Layout(8, tp=tp), Workload(1, 64), DEVICES["h100"])


def test_bad_tp_and_sequence():
    with pytest.raises(ValueError, match="tp=0"):
        Layout(8, tp=0)
    spec = ModelSpec.from_preset("1b")
    with pytest.raises(ValueError, match=r"seq=100 .* --no-sequence-parallel"):
        estimate_memory(spec, Layout(8, tp=8), Workload(1, 100))
    without_sp = Layout(8, tp=8, sequence_parallel=False)
    assert estimate_memory(spec, without_sp, Workload(1, 100)).peak > 0


def test_cli_reports_tp(tmp_path, capsys):
    out = tmp_path / "tp.json"
    argv = ["--model", "1b", "--world", "4", "--tp", "2", "--seq", "512", "--batch", "2"]
    assert main([*argv, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "world 4 x tp 2 = 8 GPUs" in table and "per GPU heads 16 (kv 4), ffn 4096" in table
    assert "tensor parallel" in table and "tp communication" in table
    data = json.loads(out.read_text())
    traffic = tp_traffic(ModelSpec.from_preset("1b"), Layout(4, tp=2, precision=BF16),
                         Workload(2, 512))  # fmt: skip
    assert data["tensor_parallel"]["collectives"]["bus_bytes"] == traffic.bus_bytes
    assert data["layout"]["tp"] == 2 and data["layout"]["gpus"] == 8
    assert data["time"]["tp_comm_s"] == data["tensor_parallel"]["comm_s"] > 0
    with pytest.raises(SystemExit):
        main(["--model", "1b", "--tp", "3"])
    assert "heads=32 is not divisible by --tp 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", "tiny", "--tp", "2", "--gpu", "cpu", "--measure"])
    assert "--measure does not support --tp" in capsys.readouterr().err
