"""The cases behind tests/test_host_blocking.py (run on every rank of a ``strict_async`` pool).

``case_steps(config)`` trains a few steps of one configuration under ``HostSyncs`` (the
virtual compute device that counts host-blocking events, ``flatshard.testing.host_sync``) and
returns each step's record: the events that block the host (``blocking``) and those counted
apart (``separate``, per reason). Each step window runs from its first forward to the end of
``opt.step()`` (and the scaler's ``update``, ``zero_grad``).

``case_usage`` checks the usage semantics on the device path: a parameter unused on every
rank keeps ``.grad is None``, one used on one rank gets the average, an MoE whose experts
change from rank to rank and step to step matches one process on the global batch.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import flatshard as fs
from flatshard.testing.host_sync import HostSyncs
from flatshard.testing.virtual_device import COMPUTE
from parity_models import CASES, mesh_for, named_param_groups
from patching import patched_attr

STEPS = 3


@dataclass(frozen=True)
class Config:
    """One configuration of the step."""

    label: str
    world: int = 2
    model: str = "gpt_tied"  # a parity_models.CASES name
    strategy: str = "full_shard"
    precision: str = "fp32"  # "bf16", or "fp16" (fp16 compute and reduction, fs.GradScaler)
    offload: bool = False
    prefetch: tuple[int, str] | None = None  # fs.Prefetch(forward, backward)
    recompute: bool = False  # fs.checkpoint_activations of the units
    micro: int = 1  # > 1: micro-batches, all but the last under fs.no_sync
    keep: str = "unsharded"  # fs.no_sync(keep=)
    coalesce: bool = True
    optimizer: str = "adamw"  # "muon" (+ AdamW for the rest), "adafactor"
    clip: str = ""  # "clip": fs.clip_grad_norm_; "nonfinite": with error_if_nonfinite=True
    compiled: bool = False  # every block's forward compiled (aot_eager, fullgraph)
    # the reasons counted apart in every steady step (a substring of each), as often as listed
    expect: tuple[str, ...] = field(default_factory=tuple)
    # reasons counted apart that may show any number of times (the model's own reads)
    allow: tuple[str, ...] = field(default_factory=tuple)


def case_steps(config: dict) -> dict:
    from flatshard.core import mesh

    c = Config(**config)
    syncs = HostSyncs()
    world, rank = dist.get_world_size(), dist.get_rank()
    with (
        patched_attr(mesh, "compute_device", lambda group: COMPUTE),
        _checkpoint_ignores_devices(),
        syncs,
    ):
        torch.manual_seed(0)
        if c.model == "pp":
            return _pp_steps(c, syncs)
        if c.model == "tp":
            return _tp_steps(c, syncs)
        model, loss_of = BUILDS.get(c.model, _parity_case)(c)
        opt = _optimizer(c, model)
        scaler = fs.GradScaler(init_scale=2.0**8) if c.precision == "fp16" else None
        for step in range(STEPS):
            local = _local_batch(c, step, world, rank)
            with syncs.step():
                _one_step(c, model, loss_of, local, opt, scaler)
    return {"steps": syncs.summary(), "mixed": sorted(set(syncs.mixed))}


def _parity_case(c: Config):
    case = CASES[c.model]
    model = fs.shard(case.build(), **_shard_kwargs(c, case))
    if c.recompute:
        fs.checkpoint_activations(model, case.policy())
    if c.compiled:
        _compile_block_forwards(model)
    return model, case.loss


def _compile_block_forwards(model: nn.Module) -> None:
    """Each block's ``forward`` compiled (aot_eager, fullgraph), run with the virtual device's
    function mode popped: Dynamo would trace that mode and guard on its tag table, recompiling
    every call. flatshard's hooks run around the compiled forward, under the mode, as in eager
    (inside a compiled graph there is no flatshard code: its hooks are untraced)."""
    from torch.overrides import _pop_mode_temporarily

    from parity_models import Block

    for block in [m for m in model.modules() if isinstance(m, Block)]:
        compiled = torch.compile(block.forward, backend="aot_eager", fullgraph=True)

        def forward(*args, _compiled=compiled, **kwargs):
            with _pop_mode_temporarily():
                return _compiled(*args, **kwargs)

        block.forward = forward


def _moe_ep(c: Config):
    """flatshard's MoEGPT with expert parallelism (world 4, ep_cases' layout): experts on
    their own mesh, tokens dispatched by all-to-all over ``mesh["ep"]``."""
    import ep_cases
    from flatshard.models.moe import MoEGPT
    from moe_cases import CONFIG

    m = ep_cases.mesh()
    model = fs.shard(MoEGPT(CONFIG, ep_group=m["ep"]), policy=ep_cases.policy_for(m))
    return model, lambda model, batch: model(batch[0], labels=batch[1])


BUILDS = {"moe_ep": _moe_ep}
_PP_MESH: list = []


def _pp_steps(c: Config, syncs: HostSyncs) -> dict:
    """A pipeline (pipeline_cases' model, world 4 = pp 2 x dp 2, torch's 1F1B schedule):
    each rank's stage sharded over dp, the step under ``fs.pipeline_step``, the norm over
    every stage (``across=`` the pp group)."""
    from torch.distributed.pipelining import PipelineStage

    import pipeline_cases as pc

    if not _PP_MESH:
        _PP_MESH.append(init_device_mesh("cpu", (pc.PP, pc.DP), mesh_dim_names=("pp", "dp")))
    mesh = _PP_MESH[0]
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    stage = pc.build_stages(pc.PP)[pp_rank]
    fs.shard(stage, policy=fs.wrap.by_type(pc.Block), mesh=mesh["dp"])
    pipe = PipelineStage(stage, pp_rank, pc.PP, COMPUTE, group=mesh["pp"].get_group())
    schedule = pc.SCHEDULES["1F1B"][0](pipe, n_microbatches=2, loss_fn=pc.loss_fn)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = pc.global_batch(step, 2)
        args = (x.chunk(pc.DP)[dp_rank].to(COMPUTE),) if pp_rank == 0 else ()
        target = y.chunk(pc.DP)[dp_rank].to(COMPUTE) if pp_rank == pc.PP - 1 else None
        with syncs.step():
            with fs.pipeline_step(schedule):
                schedule.step(*args, target=target)
            if c.clip:
                fs.clip_grad_norm_([stage], 1.0, across=mesh["pp"])
            opt.step()
            opt.zero_grad()
    return {"steps": syncs.summary(), "mixed": sorted(set(syncs.mixed))}


def _tp_steps(c: Config, syncs: HostSyncs) -> dict:
    """FSDP x TP (tp_cases' model, world 4 = dp 2 x tp 2, sequence and loss parallel):
    DTensor's redistributions are functional collectives, carried on strict_async by
    ``testing/functional_collectives.py``."""
    import tp_cases
    from flatshard.testing.functional_collectives import carried

    mesh, tp_mesh, dp_mesh, dp_size, dp_index = tp_cases._meshes(False)
    with carried():
        model = tp_cases.build().to(COMPUTE)
        tp_cases.parallelize(model, tp_mesh, sp=True, loss_par=True)
        tp_cases._shard(model, {"engine": "flatshard"}, mesh, dp_mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(STEPS):
            tokens, target = tp_cases.global_batch(step, dp_size)
            mine = slice(dp_index * tp_cases.ROWS, (dp_index + 1) * tp_cases.ROWS)
            with syncs.step():
                tp_cases.loss_of(model, tokens[mine].to(COMPUTE), target[mine].to(COMPUTE), True)
                if c.clip:
                    fs.clip_grad_norm_(model, 1.0)
                opt.step()
                opt.zero_grad()
    return {"steps": syncs.summary(), "mixed": sorted(set(syncs.mixed))}


def _local_batch(c: Config, step: int, world: int, rank: int):
    if c.model == "moe_ep":
        from moe_cases import ROWS, global_batch

        inputs, labels = global_batch(step, world)
        return inputs.split(ROWS)[rank].to(COMPUTE), labels.split(ROWS)[rank].to(COMPUTE)
    batch = CASES[c.model].batch(torch.Generator().manual_seed(step), 2 * world)
    return batch.chunk(world)[rank].to(COMPUTE)


@contextlib.contextmanager
def _checkpoint_ignores_devices():
    """torch's checkpoint compares each recomputed tensor's device with the saved one's; the
    virtual device answers ``cpu:0`` for a compute tensor only inside its mode, which the
    checkpoint's saving leaves (a difference CUDA does not have): compare shapes and dtypes."""
    import torch.utils.checkpoint as ckpt

    table = ckpt._allowed_determinism_checks_to_fns
    default = table["default"]
    table["default"] = lambda x: {"shape": x.shape, "dtype": x.dtype}
    try:
        yield
    finally:
        table["default"] = default


def _shard_kwargs(c: Config, case) -> dict:
    kwargs = dict(policy=case.policy(), strategy=c.strategy, mesh=mesh_for(c.strategy))
    if c.precision != "fp32":
        dtype = torch.bfloat16 if c.precision == "bf16" else torch.float16
        kwargs["mixed_precision"] = fs.MixedPrecision(param_dtype=dtype, reduce_dtype=dtype)
    if c.offload:
        kwargs["offload"] = fs.CPUOffload()
    if c.prefetch is not None:
        kwargs["prefetch"] = fs.Prefetch(forward=c.prefetch[0], backward=c.prefetch[1])
    if not c.coalesce:
        kwargs["coalesce"] = False
    return kwargs


def _optimizer(c: Config, model: nn.Module) -> torch.optim.Optimizer:
    if c.optimizer == "adafactor":
        return fs.optim.Adafactor(model.parameters(), lr=1e-2)
    if c.optimizer == "muon":
        matrices, others = fs.optim.muon_split(model)
        return fs.optim.Combined(
            torch.optim.AdamW(others, lr=1e-3), fs.optim.Muon(matrices, lr=0.02)
        )
    return torch.optim.AdamW(named_param_groups(model), lr=1e-3)


def _one_step(c: Config, model, loss_of, local, opt, scaler) -> None:
    parts = local.chunk(c.micro) if c.micro > 1 else [local]
    for i, part in enumerate(parts):
        last = i == c.micro - 1
        context = contextlib.nullcontext() if last else fs.no_sync(model, keep=c.keep)
        with context:
            loss = loss_of(model, part) / c.micro
            (scaler.scale(loss) if scaler is not None else loss).backward()
    if scaler is not None:
        scaler.unscale_(opt)
    if c.clip:
        fs.clip_grad_norm_(model, 1.0, error_if_nonfinite=c.clip == "nonfinite")
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad()


# ---- usage semantics on the device path ---------------------------------------------------------
class Branches(nn.Module):
    """A trunk, a branch only rank 0's rows take (``rank0``), one every rank takes on odd
    steps (``odd``) and, ``with_never``, one no rank takes (``never``)."""

    def __init__(self, with_never: bool = True) -> None:
        super().__init__()
        self.trunk = nn.Linear(7, 7)
        self.rank0, self.odd = nn.Linear(7, 7), nn.Linear(7, 7)
        self.never = nn.Linear(7, 7) if with_never else None
        self.head = nn.Linear(7, 1)

    def forward(self, x: torch.Tensor, take_rank0: bool, take_odd: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        if take_rank0:
            h = h + torch.tanh(self.rank0(h))
        if take_odd:
            h = h + torch.tanh(self.odd(h))
        return self.head(h).square().mean()


def _all_branches() -> Branches:
    return Branches(with_never=False)


class Experts(nn.Module):
    """Separate expert modules, each called only for the tokens routed to it (as Hugging
    Face's Mixtral loops over its experts): one unit, whose experts' usage differs by rank."""

    def __init__(self, experts: int, width: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, h: torch.Tensor, choice: torch.Tensor, weight: torch.Tensor):
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().flatten()  # the model's own read: not flatshard's
            if rows.numel():
                out = out.index_add(0, rows, expert(h[rows]) * weight[rows, None])
        return out


class ExpertMoE(nn.Module):
    """Top-1 routing over ``Experts``: which experts a rank uses changes with its data, step
    after step."""

    def __init__(self, experts: int = 6, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(3, width)
        self.router = nn.Linear(width, experts)
        nn.init.normal_(self.router.weight, std=2.0)  # tokens spread over the experts
        self.moe = Experts(experts, width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        weight, choice = self.router(h).softmax(-1).max(-1)
        return self.head(h + self.moe(h, choice, weight)).square().mean()


def case_usage(strategy: str) -> dict:
    """Branches and ExpertMoE, 3 steps each, sharded (every Linear its own unit) against one
    process on the global batch: per step each rank's gradient error and None mismatches, the
    experts each rank used, and the separately counted host reads."""
    from flatshard.core import mesh

    syncs = HostSyncs()
    out = {}
    with patched_attr(mesh, "compute_device", lambda group: COMPUTE), syncs:
        out["branches"] = _usage_run(Branches, _branches_loss, strategy, syncs)
        out["all_branches"] = _usage_run(_all_branches, _branches_loss, strategy, syncs)
        out["moe"] = _usage_run(ExpertMoE, _moe_loss, strategy, syncs)
    return out


def _branches_loss(model, x, chunk: int, step: int) -> torch.Tensor:
    return model(x, take_rank0=chunk == 0, take_odd=step % 2 == 1)


def _moe_loss(model, x, chunk: int, step: int) -> torch.Tensor:
    return model(x)


def _usage_run(build, loss_fn, strategy: str, syncs: HostSyncs) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    ref = build()
    # Units run on every rank (their gathers are collectives); usage differs inside them: the
    # experts are one unit (as an MoE layer is), the branches are in the root's.
    policy = fs.wrap.by_type(Experts) if build is ExpertMoE else fs.wrap.root_only()
    model = fs.shard(copy.deepcopy(ref), policy=policy, strategy=strategy,
                     mesh=mesh_for(strategy), coalesce=False)  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    steps = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 + step)
        batch = torch.randn(4 * world, 3 if build is ExpertMoE else 7, generator=gen) * 2
        chunks = batch.chunk(world)
        with syncs.step():
            loss_fn(model, chunks[rank].to(COMPUTE), rank, step).backward()
        sum(loss_fn(ref, x, r, step) for r, x in enumerate(chunks)).div(world).backward()
        steps.append(_compare(model, ref))
        steps[-1]["experts"] = _experts_used(ref, chunks[rank]) if build is ExpertMoE else []
        for o in (opt, ref_opt):
            o.step(), o.zero_grad()
    return {"steps": steps, "syncs": syncs.summary()[-STEPS:]}


def _compare(model: nn.Module, ref: nn.Module) -> dict:
    """This rank's fragments against the reference's gradients: the worst relative error,
    and the names whose ``.grad`` is None on one side only."""
    from parity_models import _grad_none_mismatches, _max_grad_err

    nones = sorted(n for n, p in ref.named_parameters() if p.grad is None)
    return {"err": _max_grad_err(model, ref), "none_mismatch": _grad_none_mismatches(model, ref),
            "none": nones}  # fmt: skip


def _experts_used(ref: ExpertMoE, x: torch.Tensor) -> list[int]:
    with torch.no_grad():
        choice = ref.router(ref.embed(x)).argmax(-1)
    return sorted(set(choice.tolist()))


def config_dicts(configs: list[Config]) -> list[dict]:
    return [asdict(c) for c in configs]
