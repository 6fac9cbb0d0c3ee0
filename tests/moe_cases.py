"""Expert parallelism against one process holding every expert: the cases behind
tests/test_models_moe.py (run on every rank of a Gloo pool).

A spec is ``dict(ep=, dp=, group=, build=)`` with ``ep * dp == world``: ``ep`` ranks share the
experts (``group``: a ``"process_group"`` or a ``"mesh"``, 1-D or the ``ep`` dim of a (dp, ep)
mesh), ``dp`` replicas of that arrangement see other data. ``build`` is ``"construct"``
(``MoEGPT(config, ep_group=...)``) or ``"shard_experts"`` (slice a full model). Every rank takes
``ROWS`` rows of one global batch; the reference, rebuilt on each rank from the same seed, holds
every expert and averages the loss over the same per-rank chunks (what DDP optimises).
Gradients of the EP model are reduced as a data-parallel wrapper must (moe.py's docstring):
non-expert ones averaged over all ranks, expert ones summed over ``dp`` and divided by the world.
Rank 0's chunk repeats one token, so its hidden states are all alike and it routes every token to
the same ``top_k`` experts: the other experts get no tokens from rank 0, and splits are uneven.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from flatshard.models.moe import Experts, MoEConfig, MoEGPT, Router, shard_experts

CONFIG = MoEConfig.preset("tiny", aux_loss_coef=0.1)
ROWS, SEQ, STEPS, LR, SEED = 2, 8, 2, 0.5, 0
REPEATED_TOKEN = 5
TIMEOUT_S = 30  # every collective of a case: a broken dispatch fails fast, not after 240 s


def global_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, labels)``, each ``[world * ROWS, SEQ]``; rank ``r`` takes rows ``r*ROWS..``."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, CONFIG.vocab_size, (world * ROWS, SEQ + 1), generator=g)
    ids[:ROWS] = REPEATED_TOKEN  # rank 0: one token, one routing (see the module docstring)
    return ids[:, :-1], ids[:, 1:]


_GROUPS: dict[tuple, tuple] = {}  # made once per worker (a Gloo group holds threads and sockets)


def groups(ep: int, dp: int, kind: str) -> tuple:
    """(the ``ep_group`` argument, the dp ProcessGroup or None), made by every rank in order."""
    key = (ep, dp, kind)
    if key not in _GROUPS:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=TIMEOUT_S)
        if kind == "process_group":
            assert dp == 1, "the process-group specs cover ep == world"
            timeout = datetime.timedelta(seconds=TIMEOUT_S)
            _GROUPS[key] = (dist.new_group(backend="gloo", timeout=timeout), None)
        elif dp == 1:
            mesh = init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
            _GROUPS[key] = (mesh, None)
        else:
            override = {"dp": ("gloo", opts), "ep": ("gloo", opts)}
            mesh = init_device_mesh(
                "cpu", (dp, ep), mesh_dim_names=("dp", "ep"), backend_override=override
            )
            _GROUPS[key] = (mesh["ep"], mesh["dp"].get_group())
    return _GROUPS[key]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius); 0 when both are zero."""
    diff = (a.double() - b.double()).norm().item()
    return diff / max(b.double().norm().item(), 1e-30) if diff else 0.0


def expert_slices(model: MoEGPT) -> dict[str, slice]:
    """Parameter name -> the rows of the full expert stack this rank holds (experts only)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, Experts):
            rows = slice(module.first, module.first + module.n_local)
            out.update({f"{name}.{p}": rows for p, _ in module.named_parameters()})
    return out


def reduce_gradients(model: MoEGPT, dp_group) -> None:
    """Data-parallel gradient reduction for EP (see the module docstring)."""
    world = dist.get_world_size()
    experts = {id(p) for m in model.modules() if isinstance(m, Experts) for p in m.parameters()}
    for p in model.parameters():
        if id(p) in experts:
            if dp_group is not None:
                dist.all_reduce(p.grad, group=dp_group)
        else:
            dist.all_reduce(p.grad)  # world: the test's world is the whole (dp, ep) grid
        p.grad /= world


def compare(model: MoEGPT, ref: MoEGPT, *, grads: bool = False) -> dict[str, tuple[float, str]]:
    """Worst relative error of this rank's parameters (or gradients) against the reference's,
    for non-expert (``dense``) and expert tensors: ``{kind: (error, name)}``."""
    slices, ref_params = expert_slices(model), dict(ref.named_parameters())
    worst = {"dense": (0.0, ""), "expert": (0.0, "")}
    for name, p in model.named_parameters():
        mine, theirs = (p.grad, ref_params[name].grad) if grads else (p, ref_params[name])
        err = rel_err(mine.detach(), theirs.detach()[slices.get(name, slice(None))])
        kind = "expert" if name in slices else "dense"
        worst[kind] = max(worst[kind], (err, name))
    return worst


def record_routing(model: MoEGPT) -> list[list[int]]:
    """Hooks that append, per router call, the assignments per expert this rank routed."""
    log: list[list[int]] = []

    def hook(router, _inputs, outputs) -> None:
        log.append(torch.bincount(outputs[1].flatten(), minlength=router.n_experts).tolist())

    for module in model.modules():
        if isinstance(module, Router):
            module.register_forward_hook(hook)
    return log


def build(spec: dict, ep_group) -> MoEGPT:
    torch.manual_seed(SEED)
    if spec["build"] == "construct":
        return MoEGPT(CONFIG, ep_group=ep_group)
    return shard_experts(MoEGPT(CONFIG), ep_group)


def reference_step(ref: MoEGPT, step: int, world: int) -> torch.Tensor:
    """The one-process loss on the global batch (mean of the per-rank chunks' losses), with its
    backward done."""
    inputs, labels = global_batch(step, world)
    chunks = zip(inputs.split(ROWS), labels.split(ROWS), strict=True)
    loss = torch.stack([ref(x, labels=y) for x, y in chunks]).mean()
    loss.backward()
    return loss.detach()


def run_spec(spec: dict) -> dict:
    """One spec on this rank: worst errors of loss and gradients over the steps (each step's
    gradients, before it updates), and of the parameters at the end."""
    world, rank = dist.get_world_size(), dist.get_rank()
    assert spec["ep"] * spec["dp"] == world, spec
    ep_group, dp_group = groups(spec["ep"], spec["dp"], spec["group"])
    torch.manual_seed(SEED)
    ref, model = MoEGPT(CONFIG), build(spec, ep_group)
    out = {"init": max(compare(model, ref).values())[0], "loss": 0.0}
    out["grads"] = {"dense": (0.0, ""), "expert": (0.0, "")}
    routing = record_routing(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=LR) for m in (model, ref))
    for step in range(STEPS):
        ref_loss = reference_step(ref, step, world)
        inputs, labels = global_batch(step, world)
        loss = model(inputs.split(ROWS)[rank], labels=labels.split(ROWS)[rank])
        loss.backward()
        reduce_gradients(model, dp_group)
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)  # world: the loss over every rank's chunk
        out["loss"] = max(out["loss"], rel_err(global_loss / world, ref_loss))
        grads = compare(model, ref, grads=True).items()
        out["grads"] = {kind: max(out["grads"][kind], err) for kind, err in grads}
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    out["params"] = compare(model, ref)
    out["routing"] = routing[: CONFIG.n_layers]  # the first step's, one list per layer
    return out


def case_parity(specs: list[dict]) -> list[dict]:
    """Every spec, in order, on this rank (one pool job per world size)."""
    return [run_spec(spec) for spec in specs]


def case_ready() -> int:
    """Nothing: waits for the pool's workers (their start-up is not a case's time)."""
    return dist.get_rank()


def merge(per_rank: list[dict]) -> dict:
    """One spec over the ranks: the worst error of each kind, and every rank's routing."""
    worst = {
        "loss": max(r["loss"] for r in per_rank),
        "init": max(r["init"] for r in per_rank),
        "routing": [r["routing"] for r in per_rank],  # [rank][layer][expert]
    }
    for what in ("grads", "params"):
        for kind in ("dense", "expert"):
            worst[f"{what}_{kind}"] = max(r[what][kind] for r in per_rank)
    return worst
