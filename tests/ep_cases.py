"""Experts on their own mesh (issue 28, goal 2): the cases behind tests/test_expert_parallel.py.

World 4 = a ("efsdp", "ep") = (2, 2) mesh. flatshard's ``MoEGPT`` holds the experts of its ep
rank (all-to-all token dispatch over ``mesh["ep"]``); ``fs.shard`` shards the dense blocks over
all four ranks and, through a policy that returns ``mesh["efsdp"]`` for ``Experts``, each
rank's experts over the two ranks that hold the same experts. After ``STEPS`` SGD-with-momentum
steps (float64: only rounding may differ) every rank's parameters must equal a one-process
``MoEGPT`` holding every expert, trained on the global batch (the mean of the per-rank chunks'
losses: what data parallelism optimises). Configurations: 4 experts (2 per ep rank, each
sharded over 2 ranks) and 2 experts (1 per ep rank: more ranks than experts).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import flatshard as fs
from flatshard.models.moe import Experts, MoEBlock, MoEGPT
from moe_cases import CONFIG, ROWS, expert_slices, global_batch, rel_err

STEPS = 3
_MESH: list = []


def mesh():
    if not _MESH:
        _MESH.append(init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep")))
    return _MESH[0]


def policy_for(m):
    """Experts over the expert-data-parallel mesh, blocks over the model's (all ranks)."""
    return lambda module: (
        m["efsdp"] if isinstance(module, Experts) else isinstance(module, MoEBlock)
    )


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def run(n_experts: int, top_k: int) -> dict:
    """This rank's worst errors: {"params": ..., "norm": ...}."""
    config = dataclasses.replace(CONFIG, n_experts=n_experts, top_k=top_k)
    m, world, rank = mesh(), dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    ref = MoEGPT(config).double()
    torch.manual_seed(0)
    model = MoEGPT(config, ep_group=m["ep"]).double()
    slices = expert_slices(model)
    fs.shard(model, policy=policy_for(m))  # dense over all ranks (mesh=None: the world)
    opt, ref_opt = _sgd(model), _sgd(ref)
    norm_err = 0.0
    for step in range(STEPS):
        inputs, labels = global_batch(step, world)
        model(inputs.split(ROWS)[rank], labels=labels.split(ROWS)[rank]).backward()
        norm = fs.clip_grad_norm_(model, 1e9).item()
        chunks = zip(inputs.split(ROWS), labels.split(ROWS), strict=True)
        torch.stack([ref(x, labels=y) for x, y in chunks]).mean().backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9).item()
        norm_err = max(norm_err, abs(norm - ref_norm) / ref_norm)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    with fs.summon_full_params(model):
        for name, p in model.named_parameters():
            expected = ref_params[name].detach()[slices.get(name, slice(None))]
            worst = max(worst, rel_err(p.detach(), expected))
    return {"params": worst, "norm": norm_err}


def errors() -> dict[str, str]:
    """Bad per-unit meshes, refused at fs.shard (every rank runs every case)."""
    m, out = mesh(), {}

    def foreign_ranks():  # model over efsdp {r, r+2}, experts over ep {r, r^1}: not a subset
        torch.manual_seed(0)
        model = MoEGPT(CONFIG, ep_group=m["ep"])
        policy = lambda module: m["ep"] if isinstance(module, Experts) else False  # noqa: E731
        fs.shard(model, policy=policy, mesh=m["efsdp"])

    def full_state_dict():  # experts whose module does not say where they sit globally
        torch.manual_seed(0)
        model = MoEGPT(CONFIG, ep_group=m["ep"])
        for module in model.modules():
            if isinstance(module, Experts):
                module.flatshard_placement = None
        fs.full_state_dict(fs.shard(model, policy=policy_for(m)))

    for name, fn in [("foreign_ranks", foreign_ranks), ("full_state_dict", full_state_dict)]:
        try:
            fn()
            out[name] = "no error"
        except (ValueError, NotImplementedError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        dist.barrier()
    return out


def run_all() -> dict:
    return {
        "4_experts": run(4, 2),
        "2_experts": run(2, 1),  # more ranks than experts: each expert sharded over 2 ranks
        "errors": errors(),
    }
