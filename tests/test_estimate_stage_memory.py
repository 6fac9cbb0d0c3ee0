"""The pipeline stage memory model (``tools/estimate/stage_memory.py``) on a tiny model whose
passes and bytes are counted by hand: torch's 1F1B and Interleaved1F1B orders, the microbatches
a rank holds, the unsharded gradient that FSDP2 accumulates under PP."""

from __future__ import annotations

import pytest

from flatshard.tools.estimate import Layout, ModelSpec, Precision, Workload
from flatshard.tools.estimate.stage_memory import rank_order, split_layers, stage_memory

# hidden 64, 4 heads of 16, MLP 128, vocabulary 128, untied
BLOCK = 4 * 64 * 64 + 2 * 64 + 3 * 64 * 128  # q, k, v, o; two norms; SwiGLU = 41,088
EMBED = 128 * 64
LAY = Layout(2, precision=Precision("bf16", "fp32"))  # FSDP 2, bf16 compute, fp32 reduction
WORK = Workload(4, 16, act_ckpt=True, fused_norm=True)  # 2 microbatches of 2 x 16 tokens
X = 2 * 16 * 64 * 2  # one block's input for one microbatch, bf16: 4,096 bytes


def _spec(layers: int) -> ModelSpec:
    return ModelSpec("tiny", layers, 64, 4, 4, 128, 128, max_seq=16)


def _phase(mem, name):
    return next(p.parts for p in mem.phases if p.name == name)


def test_torchtitan_split():
    assert split_layers(126, 8) == (15, 16, 16, 16, 16, 16, 16, 15)
    assert split_layers(126, 16) == (7,) + (8,) * 14 + (7,)
    assert split_layers(8, 4) == (2, 2, 2, 2)


def test_orders_of_torch_schedules():
    # 1F1B, pp 2, 2 microbatches: rank 0 warms up with 2 forwards, rank 1 with 1
    assert rank_order("1F1B", 2, 2, 1, 0) == [(True, 0, 0), (True, 0, 1), (False, 0, 0),
                                              (False, 0, 1)]  # fmt: skip
    assert rank_order("1F1B", 2, 2, 1, 1) == [(True, 1, 0), (False, 1, 0), (True, 1, 1),
                                              (False, 1, 1)]  # fmt: skip
    # Interleaved, pp 2, 2 stages per rank: warm-up min((2-1)*2 + 2*(2-1-0), 4) = 4 on rank 0
    assert rank_order("Interleaved1F1B", 2, 2, 2, 0) == [
        (True, 0, 0), (True, 0, 1), (True, 2, 0), (True, 2, 1),
        (False, 2, 0), (False, 2, 1), (False, 0, 0), (False, 0, 1),
    ]  # fmt: skip


def test_1f1b_first_rank_by_hand():
    """8 blocks, pp 2: rank 0 holds stage 0 (4 blocks and the embedding). Each microbatch in
    flight keeps 4 block inputs (4 X), and its output stays to the step's end (X); a gradient
    receive buffer per microbatch (2 X). At the end of the first backward: the other
    microbatch's inputs (4 X) and the first block's input (X), both outputs; the whole
    unsharded fp32 gradient and one block's bf16 one."""
    mem = stage_memory(_spec(8), LAY, WORK, "1F1B", pp=2, microbatches=2, rank=0)
    assert mem.stages == (0,) and mem.blocks == (4,)
    start = _phase(mem, "backward start (stage 0, microbatch 0)")
    assert start["activations"] == 2 * 4 * X and start["outputs"] == 2 * X
    assert start["pipe_buffers"] == 2 * X
    assert start["unit_grads"] == BLOCK * 2  # nothing accumulated yet
    end = _phase(mem, "backward end (stage 0, microbatch 0)")
    assert end["activations"] == 4 * X + X and end["outputs"] == 2 * X
    assert end["unit_grads"] == (4 * BLOCK + EMBED) * 4 + BLOCK * 2
    # gathered for the whole step: 4 blocks and the embedding, bf16
    assert end["gathered"] == (4 * BLOCK + EMBED) * 2
    assert end["parameters"] == (4 * BLOCK + EMBED) // 2 * 4  # fp32 shard of FSDP 2


def test_interleaved_holds_the_same_but_accumulates_half():
    """Same model, 2 stages per rank (2 blocks each): rank 0 holds stages 0 and 2. Before its
    first backward it holds as many block inputs as under 1F1B (the doc's reading), but stage
    2's backwards finish, and its gradient is reduced, before stage 0's first backward: the
    unsharded gradient at the peak is stage 2's alone."""
    mem = stage_memory(_spec(8), LAY, WORK, "Interleaved1F1B", 2, 2, stages_per_rank=2, rank=0)
    assert mem.stages == (0, 2) and mem.blocks == (2, 2)
    start = _phase(mem, "backward start (stage 2, microbatch 0)")
    # stage 0: 2 inputs per microbatch; stage 2: 1 input (the other is its receive buffer);
    # and each stage's output: 2 x (2 + 1) X + 2 x 2 X = 10 X, as 1F1B's 2 x (4 + 1) X
    assert start["activations"] == 6 * X and start["outputs"] == 4 * X
    assert start["pipe_buffers"] == 2 * X + 2 * 2 * X  # stage 0: grads; stage 2: inputs, grads
    end = _phase(mem, "backward end (stage 2, microbatch 0)")
    assert end["unit_grads"] == 2 * BLOCK * 4 + BLOCK * 2
    first0 = _phase(mem, "backward end (stage 0, microbatch 0)")
    assert first0["unit_grads"] == (2 * BLOCK + EMBED) * 4 + BLOCK * 2  # stage 2's reduced
    assert first0["gradients"] == -(-2 * BLOCK // 2) * 4  # stage 2's fp32 shards
    assert first0["gathered"] == (2 * BLOCK + EMBED) * 2  # stage 2 resharded


def test_refusals():
    with pytest.raises(ValueError, match="full AC"):
        stage_memory(_spec(8), LAY, Workload(4, 16), "1F1B", 2, 2)
    with pytest.raises(ValueError, match="replays"):
        stage_memory(_spec(8), LAY, WORK, "GPipe", 2, 2)
    with pytest.raises(ValueError, match="do not divide"):
        stage_memory(_spec(8), LAY, WORK, "1F1B", 2, 3)


def test_last_stage_keeps_its_logits_to_the_step_end():
    """torch's stage (the published runs' version) kept every microbatch's output in
    ``output_chunks`` until the step's end, and the schedule concatenates them there: on the
    last stage those are the logits (compute dtype, 2 x 16 tokens x vocabulary 128 x 2 bytes
    each). Under 1F1B rank 1 runs F0 B0 F1 B1: at B1 both logits are kept."""
    logits = 2 * 16 * 128 * 2
    mem = stage_memory(_spec(8), LAY, WORK, "1F1B", pp=2, microbatches=2, rank=1)
    assert _phase(mem, "loss backward (stage 1, microbatch 0)")["outputs"] == logits
    assert _phase(mem, "loss backward (stage 1, microbatch 1)")["outputs"] == 2 * logits
    merge = _phase(mem, "merge outputs")
    assert merge["outputs"] == merge["merged"] == 2 * logits
    assert merge["gradients"] == -(-(4 * BLOCK + EMBED + 64) // 2) * 4  # the fp32 shards
    # the concatenation is larger than every block before it: a segment of its own
    assert mem.reserved_parts["merged_outputs"] == 2 * logits
    first = stage_memory(_spec(8), LAY, WORK, "1F1B", pp=2, microbatches=2, rank=0)
    assert all(p.name != "merge outputs" for p in first.phases)  # only the last stage merges
    assert first.reserved_parts["merged_outputs"] == 0
