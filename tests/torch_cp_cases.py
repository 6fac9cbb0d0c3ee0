"""torch's context parallelism as the GPT's cp attention: the cases behind tests/test_torch_cp.py.

World 2 (cp 2) or 4 (dp 2 x cp 2, or dp 1 x cp 4; cp ranks consecutive, as the trainer lays
them out). The reference GPT is made context-parallel with ``attention="torch"`` (torch's
``_ContextParallel`` FlexAttention, its head-tail balancer and sharded block mask) and, for
comparison, with flatshard's ring. Each dp rank reads packed rows (several documents and a
padding tail: the document mask matters) and keeps its head-tail share, as the trainer does.
Checked on every rank: the logits of its own tokens against one process's logits of the whole
rows (torch's FlexAttention has no CPU backward in torch 2.13, so the CPU check is the forward;
see [Note: torch's context parallelism in flatshard]), and the refusal of a CPU pass that would
record gradients.
"""

from __future__ import annotations

import copy
import random

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from flatshard.models import GPT, GPTConfig
from flatshard.models.context_parallel import ContextParallel, attach, split_rows
from flatshard.packing import collate
from flatshard.tools.train.cp_plan import cp_logits, local_batch

SEQ, ROWS, VOCAB, PAD = 512, 2, 40, 0  # 512: a multiple of cp * 128 at cp 2 and 4


def _rows(dp_rank: int):
    """Packed rows of documents of 20..200 tokens (the same on every process that asks)."""
    rng = random.Random(7 + dp_rank)
    docs, used = [], 0
    while used < ROWS * SEQ - 220:
        n = rng.randint(20, 200)
        docs.append([rng.randrange(1, VOCAB) for _ in range(n)])
        used += n + 4
    return collate(docs, SEQ, pad_id=PAD, rows=ROWS)


def case_torch_cp_matches_whole_rows(cp: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    dp, cp_rank, dp_rank = world // cp, rank % cp, rank // cp
    config = GPTConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       max_seq_len=SEQ)  # fmt: skip
    torch.manual_seed(0)
    reference = GPT(config).double()
    with_torch, with_ring = copy.deepcopy(reference), copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    torch_context = attach(with_torch, mesh["cp"], "torch")
    ring_context = attach(with_ring, mesh["cp"].get_group(), "ring")
    rows = _rows(dp_rank)
    mine = local_batch(rows, cp, cp_rank)
    errors: dict = {"shape": tuple(mine.input_ids.shape)}
    with torch.no_grad():
        want = split_rows(
            reference(rows.input_ids, rows.position_ids, rows.cu_seqlens), cp, cp_rank
        )
        got = cp_logits(with_torch, torch_context, mine)
        ring = cp_logits(with_ring, ring_context, mine)
    scale = want.abs().max()
    errors["torch_vs_whole"] = float((got - want).abs().max() / scale)
    errors["torch_vs_ring"] = float((got - ring).abs().max() / scale)
    try:  # a CPU pass that records gradients: refused with the fix, before any collective
        # (a rank that issued one would leave the others waiting: the next call still works)
        cp_logits(with_torch, torch_context, mine)
        errors["refused"] = ""
    except RuntimeError as error:
        errors["refused"] = str(error)
    errors["active_after"] = torch_context.active
    try:  # torch's style needs the DeviceMesh, not its process group
        ContextParallel(mesh["cp"].get_group(), "torch")
        errors["group_refused"] = ""
    except TypeError as error:
        errors["group_refused"] = str(error)
    return errors
