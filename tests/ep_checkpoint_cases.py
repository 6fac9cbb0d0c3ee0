"""Expert-parallel checkpoints at another EP degree (issue 28 goal 3): the cases behind
tests/test_checkpoint_expert_parallel.py.

World 4, float64, SGD with momentum (the momentum buffers must travel too). A ``MoEGPT`` with 4
experts at ep 2 (experts over the ("efsdp", "ep") = (2, 2) mesh, as in ep_cases.py) trains two
steps next to a one-process model holding every expert, and saves. The checkpoint loads into
the same model built otherwise (another seed) at ep 4 (one expert per rank), ep 1 (no expert
parallelism: every rank holds every expert, all sharded over the 4 ranks) and ep 2 again; each
must then hold the reference's parameters and, after one more step, equal the reference's
next step. The ep 4 model's checkpoint loads back at ep 2 the same way.
"""

from __future__ import annotations

import dataclasses
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import flatshard as fs
from ep_cases import mesh as ep2_mesh
from flatshard.models.moe import Experts, MoEBlock, MoEGPT
from moe_cases import CONFIG, ROWS, expert_slices, global_batch, rel_err

CONFIG4 = dataclasses.replace(CONFIG, n_experts=4, top_k=2)
_EP4: list = []


def ep4_mesh():
    if not _EP4:
        _EP4.append(init_device_mesh("cpu", (1, 4), mesh_dim_names=("efsdp", "ep")))
    return _EP4[0]


def build(ep: int, seed: int) -> tuple[MoEGPT, torch.optim.Optimizer, dict]:
    """A sharded MoEGPT at ``ep`` (1, 2 or 4), its optimizer and its expert slices."""
    torch.manual_seed(seed)
    if ep == 1:
        model = MoEGPT(CONFIG4).double()
        slices = {}
        fs.shard(model, policy=fs.wrap.by_type(MoEBlock))
    else:
        m = ep2_mesh() if ep == 2 else ep4_mesh()
        model = MoEGPT(CONFIG4, ep_group=m["ep"]).double()
        slices = expert_slices(model)
        policy = lambda module: (  # noqa: E731
            m["efsdp"] if isinstance(module, Experts) else isinstance(module, MoEBlock)
        )
        fs.shard(model, policy=policy)
    return model, _sgd(model), slices


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, at: int) -> None:
    inputs, labels = global_batch(at, dist.get_world_size())
    rank = dist.get_rank()
    model(inputs.split(ROWS)[rank], labels=labels.split(ROWS)[rank]).backward()
    opt.step()
    opt.zero_grad()


def step_reference(ref: torch.nn.Module, opt: torch.optim.Optimizer, at: int) -> None:
    inputs, labels = global_batch(at, dist.get_world_size())
    chunks = zip(inputs.split(ROWS), labels.split(ROWS), strict=True)
    torch.stack([ref(x, labels=y) for x, y in chunks]).mean().backward()
    opt.step()
    opt.zero_grad()


def error(model: torch.nn.Module, slices: dict, ref: torch.nn.Module) -> float:
    """This rank's worst parameter error against the one-process ``ref``."""
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    with fs.summon_full_params(model):
        for name, p in model.named_parameters():
            want = ref_params[name].detach()[slices.get(name, slice(None))]
            worst = max(worst, rel_err(p.detach(), want))
    return worst


def fragment_info_problems(model: torch.nn.Module, ref: torch.nn.Module) -> list[str]:
    """Experts: ``fs.fragment_info``'s global shape is the whole stack, the origin this ep
    rank's first expert."""
    shapes = {n: p.shape for n, p in ref.named_parameters()}
    experts = {
        f"{n}.{w}": m.first
        for n, m in model.named_modules()
        if isinstance(m, Experts)
        for w in ("w1", "w2", "w3")
    }
    problems = []
    for name, info in fs.fragment_info(model).items():
        origin = (experts[name], 0, 0) if name in experts else (0,) * len(info.full_shape)
        if info.global_shape != shapes[name] or info.origin != origin:
            problems.append(f"{name}: {info.global_shape} at {info.origin}")
    return problems


def shared_dir() -> str:
    box = [tempfile.mkdtemp(prefix="fs-ep-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run_routes() -> dict:
    """ep 2 -> ep 4, ep 1, ep 2; ep 4 -> ep 2: this rank's errors after the load and a step."""
    root, out = shared_dir(), {}
    torch.manual_seed(0)
    ref = MoEGPT(CONFIG4).double()
    ref_opt = _sgd(ref)
    source, opt, slices = build(2, seed=0)
    for at in range(2):
        step(source, opt, at)
        step_reference(ref, ref_opt, at)
    out["ep2_trained"] = error(source, slices, ref)  # the premise: ep 2 trains exactly
    out["fragment_info"] = fragment_info_problems(source, ref)
    fs.save(f"{root}/ep2", model=source, optimizer=opt)
    after = MoEGPT(CONFIG4).double()  # the reference's next step (deepcopy: router caches)
    after.load_state_dict(ref.state_dict())
    step_reference(after, _sgd_like(after, ref_opt), 2)
    for ep in (4, 1, 2):
        model, model_opt, model_slices = build(ep, seed=1)
        fs.load(f"{root}/ep2", model=model, optimizer=model_opt)
        out[f"ep2_to_ep{ep}_loaded"] = error(model, model_slices, ref)
        step(model, model_opt, 2)
        out[f"ep2_to_ep{ep}_next_step"] = error(model, model_slices, after)
        if ep == 4:
            fs.save(f"{root}/ep4", model=model, optimizer=model_opt)
    back, back_opt, back_slices = build(2, seed=2)
    fs.load(f"{root}/ep4", model=back, optimizer=back_opt)
    out["ep4_to_ep2_loaded"] = error(back, back_slices, after)
    out.update(full_state_dicts(source, ref))
    out["safetensors_ep4"] = safetensors_into_ep4(root, ref)
    out["export_ep2"] = exported(root, source, ref)
    return out


def exported(root: str, model: torch.nn.Module, ref: torch.nn.Module) -> float:
    """``fs.export_safetensors`` of the ep 2 model against the reference's state dict (rank 0
    reads the file; the others report 0.0)."""
    from safetensors.torch import load_file

    path = f"{root}/export.safetensors"
    fs.export_safetensors(model, path)
    if dist.get_rank() != 0:
        return 0.0
    written, want = load_file(path), ref.state_dict()
    if set(written) != set(want):
        return float("inf")
    return max(rel_err(written[k], v) for k, v in want.items())


def safetensors_into_ep4(root: str, ref: torch.nn.Module) -> float:
    """The reference's weights as one safetensors file, read by ``fs.load`` into an ep 4
    model: each rank reads its experts' slices of the stacked tensors."""
    from safetensors.torch import save_file

    path = f"{root}/weights.safetensors"
    if dist.get_rank() == 0:
        save_file({k: v.detach().clone() for k, v in ref.state_dict().items()}, path)
    dist.barrier()
    model, _, slices = build(4, seed=4)
    fs.load(path, model=model)
    return error(model, slices, ref)


def full_state_dicts(source: torch.nn.Module, ref: torch.nn.Module) -> dict:
    """``fs.full_state_dict`` of the ep 2 model (global expert stacks, on rank 0) against the
    reference, and ``fs.load_full_state_dict`` of the reference's into a fresh ep 4 model."""
    out = {}
    full = fs.full_state_dict(source)
    if dist.get_rank() == 0:
        ref_sd = ref.state_dict()
        keys_ok = list(full) == list(ref_sd)
        out["full_state_dict"] = max(rel_err(full[k], v) for k, v in ref_sd.items())
        out["full_state_dict"] = out["full_state_dict"] if keys_ok else float("inf")
    else:
        out["full_state_dict"] = 0.0 if full == {} else float("inf")
    target, _, target_slices = build(4, seed=3)
    fs.load_full_state_dict(target, ref.state_dict() if dist.get_rank() == 0 else {})
    out["load_full_state_dict_ep4"] = error(target, target_slices, ref)
    return out


def _sgd_like(model: torch.nn.Module, like: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """An SGD over ``model`` carrying ``like``'s state (momentum), for a copied reference."""
    opt = _sgd(model)
    opt.load_state_dict(like.state_dict())
    return opt
