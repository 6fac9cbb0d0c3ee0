"""torch's context parallelism (``attention="torch"``, ``--parallelism.cp_attention torch``).

* torch's head-tail balancer gives every cp rank the tokens ``head_tail_indices`` gives it, so
  the trainer's split, positions and loss hold under torch's attention too.
* At dp 2 x cp 2 and dp 1 x cp 4 (world 4), the GPT with torch's
  context-parallel FlexAttention gives, on every rank, the logits of one process on the whole
  packed rows, and those of flatshard's ring (float64; forward only: torch 2.13's FlexAttention
  has no CPU backward); a CPU pass that records gradients is refused with the fix.
* The trainer resolves ``cp_attention=auto`` to torch's on CUDA (rows it can split) and to the
  ring elsewhere, and refuses ``torch`` where it cannot train.
"""

from __future__ import annotations

import pytest
from torch.distributed.tensor.experimental._context_parallel import _HeadTailLoadBalancer

from flatshard.models.context_parallel import head_tail_indices
from flatshard.models.torch_cp_attention import check_row_length
from flatshard.tools.train.cli import parse_config
from flatshard.tools.train.cp_plan import check_cp, resolve_cp_attention
from torch_cp_cases import case_torch_cp_matches_whole_rows


@pytest.mark.parametrize(("seq", "cp"), [(16, 2), (24, 3), (512, 4)])
def test_torch_balancer_gives_each_rank_the_head_tail_split(seq, cp):
    order = _HeadTailLoadBalancer(seq, cp, "cpu")._generate_indices()[0]  # [seq], rank order
    for rank, share in enumerate(order.split(seq // cp)):
        assert share.tolist() == head_tail_indices(seq, cp, rank).tolist()


@pytest.mark.parametrize(("world", "cp"), [(4, 2), (4, 4)])  # one pool: one block-mask compile
def test_torch_cp_logits_equal_the_whole_rows(dist_pools, world, cp):
    for rank, result in enumerate(dist_pools(world).run(case_torch_cp_matches_whole_rows, cp)):
        assert result["shape"] == (2, 512 // cp), (rank, result)
        assert result["torch_vs_whole"] < 1e-12, (rank, result)
        assert result["torch_vs_ring"] < 1e-12, (rank, result)
        assert "cannot train on the CPU" in result["refused"], (rank, result)
        assert "attention='ring'" in result["refused"], (rank, result)
        assert result["active_after"] is False, (rank, result)
        assert "pass mesh['cp']" in result["group_refused"], (rank, result)


def test_torch_cp_row_length_is_checked_with_the_fix():
    check_row_length(512, 4)
    with pytest.raises(ValueError, match=r"seq_len=384 is not a multiple of cp \* 128 = 256"):
        check_row_length(384, 2)


def _cfg(*args: str):
    return parse_config(["--parallelism.cp", "2", *args])[0]


def test_cp_attention_auto_picks_torch_on_cuda_and_the_ring_elsewhere():
    assert parse_config([])[0].parallel.cp_attention == "auto"
    assert resolve_cp_attention(_cfg("--data.seq_len", "512"), "cuda") == "torch"
    assert resolve_cp_attention(_cfg("--data.seq_len", "512"), "cpu") == "ring"
    # a row torch's block mask cannot split: the ring, on CUDA too
    assert resolve_cp_attention(_cfg("--data.seq_len", "384"), "cuda") == "ring"
    for chosen in ("ring", "allgather", "torch"):
        cfg = _cfg("--data.seq_len", "512", "--parallelism.cp_attention", chosen)
        assert resolve_cp_attention(cfg, "cuda") == chosen


def test_cp_attention_torch_is_refused_where_it_cannot_train():
    cfg = _cfg("--data.seq_len", "512", "--parallelism.cp_attention", "torch")
    check_cp(cfg, 4, "cuda")
    with pytest.raises(ValueError, match=r"cp_attention='torch' cannot train on cpu.*ring"):
        check_cp(cfg, 4, "cpu")
    cfg = _cfg("--data.seq_len", "384", "--parallelism.cp_attention", "torch")
    with pytest.raises(ValueError, match=r"seq_len=384 is not a multiple of cp \* 128"):
        check_cp(cfg, 4, "cuda")
