"""The reserved-memory estimate (``tools/estimate/reserved.py``), each part against its figure
computed by hand from the model's sizes, and the CLI's labels (allocated vs reserved)."""

from __future__ import annotations

import json

import pytest

from flatshard.tools.estimate import Layout, ModelSpec, Precision, Workload, estimate_memory, main
from flatshard.tools.estimate.reserved import (
    FSDP2_GATHERS_IN_FLIGHT,
    TP_RECORD_STREAM_BUFFERS,
    estimate_reserved,
    loss_extras,
)

TT_MP = Precision("bf16", "fp32")  # torchtitan: bf16 parameters, fp32 reduction
LLAMA_8B = ModelSpec("llama3.1-8b", 32, 4096, 32, 8, 128256, 14336, max_seq=8192)
LLAMA_70B = ModelSpec("llama3.1-70b", 80, 8192, 64, 8, 128256, 28672, max_seq=8192)
V = 128256


def _reserved(spec, layout, work, runtime="torchtitan"):
    mem = estimate_memory(spec, layout, work)
    return mem, estimate_reserved(spec, layout, work, mem, runtime)


def test_fsdp_8b_parts_by_hand():
    """8 B, FSDP 8, batch 2 x 8192 under torchtitan: the bf16 logits' hole, every fp32 gradient
    shard in the reduce-scatter pool, the root (embedding, norm, head) in the all-gather pool,
    and the embedding FSDP2 keeps gathered where flatshard's lazy root released it."""
    work = Workload(2, 8192, fused_norm=True, selective_ac=True)
    mem, res = _reserved(LLAMA_8B, Layout(8, precision=TT_MP), work)
    assert res.loss_extra == {"hole": 16384 * V * 2, "loss_parallel": 0}
    # 8 B parameters over 8 ranks in fp32 (the shards carry a few elements of padding)
    assert res.reduce_scatter_pool == pytest.approx(LLAMA_8B.params / 8 * 4, rel=1e-5)
    root = 2 * V * 4096 + 4096
    assert root > FSDP2_GATHERS_IN_FLIGHT * LLAMA_8B.block_params
    assert res.all_gather_pool == root * 2
    assert res.tp_record_stream == 0
    assert res.root_held == V * 4096 * 2  # the embedding, bf16
    assert mem.peak_phase == "loss backward"  # the extras land on the peak
    assert res.default_stream == mem.peak + 16384 * V * 2 + V * 4096 * 2
    assert res.total == res.default_stream + res.reduce_scatter_pool + res.all_gather_pool


def test_flatshard_runtime_has_one_pool():
    """flatshard allocates its side streams' buffers on the compute stream (core/streams.py,
    rule 1): no side pools and no held root; the loss's hole stays."""
    work = Workload(2, 8192, fused_norm=True, selective_ac=True)
    mem, res = _reserved(LLAMA_8B, Layout(8, precision=TT_MP), work, "flatshard")
    assert res.reduce_scatter_pool == res.all_gather_pool == res.root_held == 0
    assert res.total == res.default_stream == mem.peak + 16384 * V * 2
    with pytest.raises(ValueError, match="runtime"):
        estimate_reserved(LLAMA_8B, Layout(8), work, mem, "megatron")


def test_tp_parts_vanilla_and_async():
    """70 B, FSDP 32 x TP 8, batch 16 x 8192: loss parallel's third fp32 temporary of the local
    logits (vocab / 8), and vanilla TP's full-sequence buffers that async TP does not hold."""
    work = Workload(16, 8192, act_ckpt=True, fused_norm=True, compile=True)
    n, local_v = 16 * 8192, V // 8
    _, vanilla = _reserved(LLAMA_70B, Layout(32, tp=8, precision=TT_MP), work)
    _, asyn = _reserved(LLAMA_70B, Layout(32, tp=8, async_tp=True, precision=TT_MP), work)
    assert vanilla.loss_extra == {"hole": n * local_v * 2, "loss_parallel": n * local_v * 4}
    assert vanilla.tp_record_stream == TP_RECORD_STREAM_BUFFERS * n * 8192 * 2
    assert asyn.tp_record_stream == 0
    assert vanilla.total - asyn.total == vanilla.tp_record_stream
    assert vanilla.all_gather_pool == (2 * local_v * 8192 + 8192) * 2  # the root, TP-sharded
    assert vanilla.root_held == 0  # under TP flatshard keeps its root gathered too


def test_cp_uses_the_local_sequence_and_the_flat_dp_cp_shards():
    """FSDP 4 x CP 2 at 65,536 tokens: one GPU's logits are 32,768 tokens long and its gradient
    shards 1/8 of the model, as at FSDP 8 x CP 1 with 32,768 tokens."""
    work = Workload(1, 65536, act_ckpt=True, fused_norm=True)
    _, cp2 = _reserved(LLAMA_8B, Layout(4, cp=2, precision=TT_MP), work)
    _, cp1 = _reserved(LLAMA_8B, Layout(8, precision=TT_MP), Workload(1, 32768, act_ckpt=True,
                                                                      fused_norm=True))  # fmt: skip
    assert cp2.loss_extra["hole"] == 32768 * V * 2
    assert cp2 == cp1


def test_fp32_compute_leaves_no_logits_hole():
    """Without the bf16 -> fp32 copy the log-softmax's input is the logits, freed whole."""
    assert loss_extras(LLAMA_8B, Layout(8), Workload(1, 1024))["hole"] == 0


def test_cli_labels_allocated_and_reserved(capsys):
    """The table and the JSON say which figure is the allocated peak and which the reserved
    estimate; on the CPU (no caching allocator) there is no reserved estimate."""
    argv = ["--model", "1b", "--world", "8", "--gpu", "h100", "--runtime", "torchtitan"]
    assert main([*argv, "--json", "-"]) == 0
    mem = json.loads(capsys.readouterr().out)["memory_bytes"]
    assert mem["peak_kind"].startswith("allocated") and mem["reserved_est"] > mem["peak"]
    assert mem["reserved_runtime"] == "torchtitan"
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert (
        "allocated peak (at" in table and "reserved (est.: torch.cuda.max_memory_reserved)" in table
    )
    assert main(["--model", "tiny", "--gpu", "cpu", "--json", "-"]) == 0
    assert "reserved_est" not in json.loads(capsys.readouterr().out)["memory_bytes"]
