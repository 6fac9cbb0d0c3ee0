"""Context parallelism against a single process: the cases behind tests/test_train_cp.py.

World 4 = dp 2 x cp 2, or dp 1 x cp 4 (cp ranks consecutive, as the trainer lays them out;
cp 4 is where a ring's direction matters: at cp 2 a rank's next and previous peers are the
same), with the ring or the all-gather attention. The reference GPT
(grouped-query attention, RoPE) is made context-parallel with
``flatshard.models.context_parallel.attach`` and sharded by ``fs.shard`` over all four ranks
(the flattened dp x cp mesh). Each dp rank reads its own packed micro-batch (several documents
per row and a padding tail, so the per-document mask matters) and each cp rank keeps its
head-tail share of every row, exactly as ``flatshard train --parallelism.cp 2`` does.

The reference is one process training the same model (no sharding, no cp) on the whole global
batch with the mean token loss. Checked on every rank, every step: this rank's own token-loss
sum (its head-tail tokens only) against the reference's losses of the same tokens, and the
global loss and gradient norm; after the last step the full state dict (rank 0 gathers every
rank's shards).
"""

from __future__ import annotations

import copy
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import flatshard as fs
from flatshard.models import GPT, Block, GPTConfig
from flatshard.models.context_parallel import attach, split_rows
from flatshard.packing import collate, global_token_count
from flatshard.tools.train.cp_plan import cp_logits, local_batch

SEQ, ROWS, VOCAB, STEPS, PAD = 32, 2, 40, 3, 0
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
}


def _batch(step: int, dp_rank: int):
    """Step ``step``'s packed micro-batch of data-parallel rank ``dp_rank`` (the same on every
    process that asks): documents of 3..20 tokens filling ``ROWS`` rows of ``SEQ``."""
    rng = random.Random(1000 * step + dp_rank)
    docs, used = [], 0
    while used < ROWS * SEQ - 24:
        n = rng.randint(3, 20)
        docs.append([rng.randrange(1, VOCAB) for _ in range(n)])
        used += n + 4  # leave room: collate never splits a document across rows
    return collate(docs, SEQ, pad_id=PAD, rows=ROWS)


def _token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[rows, T]`` cross-entropy per token (0 where the label is -100)."""
    flat = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    return flat.view(labels.shape)


def case_cp_matches_single_process(
    optimizer: str, dtype_name: str, cp: int = 2, attention: str = "ring"
) -> dict:
    dtype = getattr(torch, dtype_name)
    rank, world = dist.get_rank(), dist.get_world_size()
    dp, cp_rank, dp_rank = world // cp, rank % cp, rank // cp
    config = GPTConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       max_seq_len=SEQ)  # fmt: skip
    torch.manual_seed(0)
    reference = GPT(config).to(dtype)
    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    context = attach(model, mesh["cp"].get_group(), attention)
    model = fs.shard(model, policy=fs.wrap.by_type(Block))  # over all ranks: dp x cp
    opt, ref_opt = (
        OPTIMIZERS[optimizer](model.parameters()),
        OPTIMIZERS[optimizer](reference.parameters()),
    )
    errors = {"own_tokens": 0.0, "loss": 0.0, "grad_norm": 0.0}
    for step in range(STEPS):
        mine = local_batch(_batch(step, dp_rank), cp, cp_rank)
        targets = global_token_count(mine.labels)  # each token on exactly one rank
        logits = cp_logits(model, context, mine)  # [ROWS, SEQ / cp, V]
        # packed_cross_entropy's normalisation (world * own sum / global count), in float64:
        # it computes in float32, which would hide a 1e-8 error here
        own = _token_losses(logits, mine.labels).sum()
        loss = world * own / targets
        loss.backward()
        own_sum = own.detach()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        norm = fs.clip_grad_norm_(model, max_norm=float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)

        full = [_batch(step, d) for d in range(dp)]
        ids, labels = torch.cat([b.input_ids for b in full]), torch.cat([b.labels for b in full])
        cu = _concat_cu_seqlens([b.cu_seqlens for b in full])
        pos = torch.cat([b.position_ids for b in full])
        ref_logits = reference(ids, pos, cu)  # packed, causal per document
        ref_tokens = _token_losses(ref_logits, labels)  # [dp * ROWS, SEQ]
        ref_loss = ref_tokens.sum() / (labels != -100).sum()
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

        my_rows = ref_tokens.detach()[dp_rank * ROWS : (dp_rank + 1) * ROWS]
        ref_own = split_rows(my_rows, cp, cp_rank).sum()
        for key, got, want in (("own_tokens", own_sum, ref_own),
                               ("loss", global_loss / world, ref_loss.detach()),
                               ("grad_norm", norm, ref_norm)):  # fmt: skip
            rel = abs(float(got) - float(want)) / max(abs(float(want)), 1e-30)
            errors[key] = max(errors[key], rel)
    state = fs.full_state_dict(model)
    if state:
        expected = reference.state_dict()
        errors["params"] = max(
            ((state[k].to(dtype) - v).abs().max() / v.abs().max().clamp(min=1e-30)).item()
            for k, v in expected.items()
        )
        errors["param_count"] = len(state)
    errors["final_loss"] = float(ref_loss.detach())
    return errors


def _concat_cu_seqlens(parts: list[torch.Tensor]) -> torch.Tensor:
    """The ``cu_seqlens`` of micro-batches stacked row-wise (offsets shifted by each part)."""
    out, offset = [parts[0][:1]], 0
    for cu in parts:
        out.append(cu[1:] + offset)
        offset += int(cu[-1])
    return torch.cat(out)
