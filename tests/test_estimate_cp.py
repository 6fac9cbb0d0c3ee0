"""``flatshard estimate --cp``: context parallelism (``tools/estimate/cp_cost.py``, its Note).
Every expectation is computed by hand from the sizes: the sequence split over cp GPUs, FSDP
over the flattened dp x cp mesh, the ring's K/V exchange per layer."""

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
from flatshard.tools.estimate.cp_cost import cp_traffic

BF16 = Precision("bf16")
LLAMA_8B = ModelSpec("llama3.1-8b", 32, 4096, 32, 8, 128256, 14336, max_seq=65536)
SEQ = 65536


def test_cp1_changes_nothing():
    work = Workload(1, 8192, act_ckpt=True, fused_norm=True)
    lay = Layout(8, precision=BF16)
    assert estimate_memory(LLAMA_8B, dataclasses.replace(lay, cp=1), work) == estimate_memory(
        LLAMA_8B, lay, work
    )
    t = estimate_time(LLAMA_8B, lay, work, DEVICES["h100"])
    assert t.cp_bytes == t.cp_comm_s == t.cp_exposed_s == 0


def test_memory_is_sharded_over_dp_x_cp_and_activations_split_over_cp():
    """FSDP 4 x CP 2: model states 16 bytes per parameter over 8 GPUs; a checkpointed block
    keeps its input of seq/2 tokens."""
    work = Workload(1, SEQ, act_ckpt=True, fused_norm=True)
    cp2 = estimate_memory(LLAMA_8B, Layout(4, cp=2, precision=BF16), work)
    assert cp2.model_states == pytest.approx(16 * LLAMA_8B.params / 8, rel=0.001)
    half = activations(LLAMA_8B, Layout(8, precision=BF16), dataclasses.replace(work, seq=SEQ // 2))
    kept = 32 * (SEQ // 2) * 4096 * 2  # 32 block inputs of 32768 tokens, bf16
    assert cp2.activations == kept + half.head + half.fixed
    whole = estimate_memory(LLAMA_8B, Layout(4, precision=BF16), work)
    assert cp2.activations < 0.51 * whole.activations  # about half: the head's logits too
    assert cp2.buffers == whole.buffers  # the RoPE tables stay whole


def test_ring_bytes_by_hand():
    """Per layer a hop moves one GPU's K and V (32768 tokens x 2 x 1024 x 2 bytes); cp - 1 hops
    in forward, again in the recomputed forward (full AC), twice in backward."""
    work = Workload(1, SEQ, act_ckpt=True)
    for cp in (2, 4):
        t = cp_traffic(LLAMA_8B, Layout(8 // cp, cp=cp, precision=BF16), work)
        hop = SEQ // cp * 2 * 1024 * 2
        assert t.hop == hop and t.hops == 32 * (cp - 1) * 4
    no_ckpt = cp_traffic(LLAMA_8B, Layout(4, cp=2, precision=BF16), Workload(1, SEQ))
    assert no_ckpt.hops == 32 * 3
    tp = cp_traffic(LLAMA_8B, Layout(4, cp=2, tp=2, precision=BF16), work)
    assert tp.hop == SEQ // 2 * 2 * 512 * 2  # tp splits the kv heads


def test_step_time_by_hand():
    """cp 2: each GPU computes half the tokens' linears and the head; its queries meet all
    65536 keys; the ring (17.2 GB at 360 GB/s, 48 ms) hides under attention (seconds)."""
    dev, work = DEVICES["h100"], Workload(1, SEQ, act_ckpt=True)
    t = estimate_time(LLAMA_8B, Layout(4, cp=2, precision=BF16), work, dev)
    n = SEQ // 2
    linear = 4 / 3 * 6 * 32 * LLAMA_8B.block_params * n
    head = 6 * 128256 * 4096 * n
    attention = 4 / 3 * 12 * 32 * 4096 * SEQ * n
    assert t.flops == pytest.approx(linear + head + attention)
    assert t.compute_s == pytest.approx((linear + head + attention / 1.5) / (989e12 * 0.4))
    ring = 32 * 1 * 4 * n * 2 * 1024 * 2
    assert t.cp_bytes == ring and t.cp_comm_s == pytest.approx(ring / 360e9)
    assert t.cp_exposed_s == 0
    assert t.tokens_per_s == pytest.approx(SEQ / t.step_s / 2)
    # the dp collectives run over the flattened 8 GPUs: reduce-scatter as FSDP 8's
    flat = estimate_time(LLAMA_8B, Layout(8, precision=BF16), Workload(1, SEQ // 2), dev)
    assert t.reduce_scatter_bytes == flat.reduce_scatter_bytes


def test_a_slow_ring_is_exposed_beyond_attention():
    dev, work = DEVICES["h100"], Workload(1, SEQ, act_ckpt=True)
    t = estimate_time(LLAMA_8B, Layout(4, cp=2, precision=BF16), work, dev, intra_gbps=0.01)
    attention = 4 / 3 * 12 * 32 * 4096 * SEQ * (SEQ // 2) / 1.5 / (989e12 * 0.4)
    assert t.cp_comm_s == pytest.approx(t.cp_bytes / 0.01e9)
    assert t.cp_exposed_s == pytest.approx(t.cp_comm_s - attention)
    assert t.step_s == pytest.approx(t.compute_s + t.exposed_comm_s + t.cp_exposed_s)


def test_a_ring_beyond_a_node_uses_the_inter_node_bandwidth():
    dev, work = DEVICES["h100"], Workload(1, SEQ)
    t = estimate_time(LLAMA_8B, Layout(1, cp=4, tp=4, precision=BF16), work, dev)
    assert t.cp_comm_s == pytest.approx(t.cp_bytes / (dev.inter_gbps * 1e9))


def test_cp_refusals():
    with pytest.raises(ValueError, match=r"seq=102 .* 2 x --cp 2"):
        estimate_memory(LLAMA_8B, Layout(4, cp=2), Workload(1, 102))
    with pytest.raises(ValueError, match="--attention flash"):
        estimate_memory(LLAMA_8B, Layout(4, cp=2), Workload(1, 128, attention="math"))
    with pytest.raises(ValueError, match="cp=0"):
        Layout(4, cp=0)


def test_cli_reports_cp(tmp_path, capsys):
    out = tmp_path / "cp.json"
    argv = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8", "--ffn",
            "14336", "--vocab", "128256", "--seq", str(SEQ), "--world", "4", "--cp", "2",
            "--act-ckpt", "--compile", "--float8", "--gpu", "h100-gt"]  # fmt: skip
    assert main([*argv, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "world 4 x cp 2 = 8 GPUs" in table and "shard over 8" in table
    assert "cp ring" in table and "torch.compile, float8" in table
    data = json.loads(out.read_text())
    assert data["layout"]["cp"] == 2 and data["layout"]["gpus"] == 8
    assert data["time"]["cp_bytes"] == 32 * 4 * (SEQ // 2) * 2 * 1024 * 2
    with pytest.raises(SystemExit):
        main([*argv[:-2], "--seq", "102"])
    assert "2 x --cp 2" in capsys.readouterr().err
