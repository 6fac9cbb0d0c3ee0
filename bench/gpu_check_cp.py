"""The ``torch_cp`` section of ``bench/gpu_check.py``: torch's context-parallel attention on a GPU.

``--parallelism.cp_attention torch`` (flatshard.models.torch_cp_attention) trains only on an
accelerator: torch 2.13's FlexAttention has no CPU backward, so the CPU suite checks its forward
alone (tests/test_torch_cp.py). One GPU cannot hold a cp group of two (NCCL takes one rank per
GPU), so this runs it at cp 1 on a 1-D mesh of one rank: the same code (torch's
``_ContextParallel`` pre-hook and its all-gather, the block mask sharded by torch's head-tail
balancer, FlexAttention compiled, the backward through all of them) on packed rows of several
documents, one SGD step against the unsharded model's packed attention (varlen, causal per
document). Checks the loss and every gradient within ``CP_TOL`` (fp32, TF32 off: FlexAttention
and the varlen kernel sum in different orders).
"""

from __future__ import annotations

import copy
import dataclasses
import random

import torch
import torch.nn.functional as F
from gpu_check_common import Ctx, rel_err

import flatshard as fs
from flatshard.models import Block
from flatshard.models.context_parallel import attach
from flatshard.packing import collate
from flatshard.tools.train.cp_plan import cp_logits, local_batch

CP_TOL = 1e-4


def _packed_rows(c: Ctx):
    """Two rows of ``c.seq`` tokens packed with documents of 10..120 tokens, on the device."""
    rng, vocab, docs, used = random.Random(3), c.cfg.vocab_size, [], 0
    while used < 2 * c.seq - 130:
        n = rng.randint(10, 120)
        docs.append([rng.randrange(1, vocab) for _ in range(n)])
        used += n + 4
    rows = collate(docs, c.seq, pad_id=0, rows=2)
    moved = {f.name: getattr(rows, f.name) for f in dataclasses.fields(rows)}
    return dataclasses.replace(
        rows, **{k: v.to(c.device) for k, v in moved.items() if torch.is_tensor(v)}
    )


def _mean_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def check_torch_cp(c: Ctx) -> dict:
    if not c.cuda:
        return {"skipped": "CUDA only: FlexAttention has no CPU backward (torch 2.13); the "
                "CPU suite checks this path's forward (tests/test_torch_cp.py)"}  # fmt: skip
    if c.seq % 128:
        return {"skipped": f"--seq {c.seq} is not a multiple of 128 (torch's mask block)"}
    from torch.distributed.device_mesh import init_device_mesh

    rows = _packed_rows(c)
    ref = c.ref()
    model = copy.deepcopy(c.base).to(c.device)
    context = attach(model, init_device_mesh("cuda", (1,), mesh_dim_names=("cp",)), "torch")
    model = fs.shard(model, policy=fs.wrap.by_type(Block))
    want = _mean_loss(ref(rows.input_ids, rows.position_ids, rows.cu_seqlens), rows.labels)
    got = _mean_loss(cp_logits(model, context, local_batch(rows, 1, 0)), rows.labels)
    want.backward()
    got.backward()
    grads = dict(model.named_parameters())
    grad_err = max(rel_err(grads[n].grad, p.grad.reshape(-1)) for n, p in ref.named_parameters())
    loss_err = abs(got.item() - want.item()) / abs(want.item())
    ok = loss_err < CP_TOL and grad_err < CP_TOL
    return {"ok": ok, "loss_err": loss_err, "grad_err": grad_err, "loss": got.item()}
