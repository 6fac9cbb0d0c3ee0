"""Cases run under virtual streams (``flatshard.testing.virtual_streams``) on a ``strict_async``
pool: hand-written misuses the backend must catch, a correct program it must pass, torch's
FSDP2, and flatshard's device path (``DEVICE_PATH``: parity as under ``nccl_slice``, and zero
violations).

``run_stream_cases`` runs a list of ``(label, module, function, args)`` on every rank, each one
inside its own ``virtual_streams.session()`` (the model is built inside it, so ``fs.shard``
picks the virtual streams), and returns per label the result, the error (a traceback), the
NCCL-semantics report and the stream violations.
"""

from __future__ import annotations

import importlib
import traceback

import torch
import torch.distributed as dist

from flatshard.testing import nccl_semantics as ns
from flatshard.testing import virtual_streams as vs

API = vs.API


def run_stream_cases(cases: list[tuple[str, str, str, tuple]]) -> dict[str, dict]:
    ns.configure(raise_on_violation=False)
    out: dict[str, dict] = {}
    try:
        for label, module, name, args in cases:
            ns.reset()
            result, error = None, None
            with vs.session() as world:
                try:
                    result = getattr(importlib.import_module(module), name)(*args)
                except Exception:  # the case fails; the next ones still run
                    error = traceback.format_exc()
                violations = [str(v) for v in world.violations]
                kinds = [v.kind for v in world.violations]
                collectives = dict(world.issuers)
            out[label] = {
                "result": result,
                "error": error,
                "report": ns.report(),
                "streams": violations,
                "kinds": kinds,
                "collectives": collectives,
            }
    finally:
        ns.configure(raise_on_violation=True)
    return out


def assert_clean(r: dict, rank: int, label: str) -> None:
    """One case's result on one rank: it ran, with no stream violation, no NCCL-semantics
    violation and no collective left unwaited."""
    assert r["error"] is None, f"{label} rank {rank}:\n{r['error']}"
    assert r["streams"] == [], f"{label} rank {rank}:\n" + "\n".join(r["streams"])
    assert r["report"]["violations"] == [], (label, rank, r["report"]["violations"])
    assert r["report"]["never_waited"] == [], (label, rank, r["report"]["never_waited"])


# ---- misuses the backend must catch ------------------------------------------------------------
def _world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def misuse_missing_wait_stream() -> None:
    """The side stream issues a gather of a shard the compute stream just wrote, without
    ``side.wait_stream(compute)``: the collective may read it before it is written."""
    rank, world = _world()
    shard = torch.full((4,), float(rank))  # written on the compute stream
    out = torch.empty(4 * world)
    side = API.Stream()
    side.wait_stream(API.current_stream())  # ordered after the allocation of out ...
    shard.mul_(2)  # ... but not after this write
    with API.stream(side):
        work = dist.all_gather_single(out, shard, async_op=True)
    work.wait()


def misuse_wait_on_wrong_stream_then_free() -> None:
    """A reduce-scatter issued from a side stream is waited on that side stream, then its
    input (allocated on the compute stream) is freed: the allocator hands it to the compute
    stream, which is not ordered after the collective."""
    rank, world = _world()
    full = torch.arange(4.0 * world) + rank  # allocated on the compute stream
    out = torch.empty(4)
    side = API.Stream()
    side.wait_stream(API.current_stream())
    with API.stream(side):
        work = dist.reduce_scatter_single(out, full, async_op=True)
        work.wait()  # orders the side stream only
    del full  # the last reference: freed now, reusable by the compute stream
    API.current_stream().wait_stream(side)
    out.sum()


def misuse_read_before_wait() -> None:
    """An all-reduce's output read on the compute stream before its ``wait()``."""
    tensor = torch.ones(3)
    work = dist.all_reduce(tensor, async_op=True)
    tensor.sum()
    work.wait()


def misuse_functional_read_before_wait() -> None:
    """A functional collective's result (DTensor's kind: ``torch.ops._c10d_functional``)
    read on the compute stream before ``wait_tensor``."""
    rank, world = _world()
    name = dist.group.WORLD.group_name
    out = torch.ops._c10d_functional.all_gather_into_tensor(torch.full((2,), rank), world, name)
    out.sum()
    torch.ops._c10d_functional.wait_tensor(out)


def misuse_compiled_read_before_wait() -> None:
    """A compiled function (``aot_eager``, ``fullgraph``) reads an all-reduce's output on the
    compute stream before its ``wait()``: the compiled graph's ops are recorded too."""
    compiled = torch.compile(lambda t: (t * 2).sum(), backend="aot_eager", fullgraph=True)
    tensor = torch.ones(3)
    work = dist.all_reduce(tensor, async_op=True)
    compiled(tensor)
    work.wait()


def misuse_gather_buffer_reused_while_reduced() -> None:
    """A gathered buffer becomes a reduce-scatter's input on the reduce stream; the compute
    stream hands it back to a pool and the next gather (on the gather stream) writes it
    while the reduce-scatter still reads it."""
    rank, world = _world()
    compute, gather, reduce = API.current_stream(), API.Stream(), API.Stream()
    buf, shard = torch.empty(4 * world), torch.full((4,), float(rank))
    gather.wait_stream(compute)
    with API.stream(gather):
        work = dist.all_gather_single(buf, shard, async_op=True)
    work.wait()  # compute waits for the gather
    out = torch.empty(4)
    reduce.wait_stream(compute)
    with API.stream(reduce):
        rs = dist.reduce_scatter_single(out, buf, async_op=True)
    # buf "released" to the pool here; the next unit's gather reuses it
    nxt = shard + 1
    gather.wait_stream(compute)
    with API.stream(gather):
        again = dist.all_gather_single(buf, nxt, async_op=True)
    again.wait()
    rs.wait()


def misuse_resize_in_flight() -> None:
    """flatshard's way of freeing a gather buffer (``resize_(0)``) before its wait."""
    rank, world = _world()
    out, shard = torch.empty(4 * world), torch.full((4,), float(rank))
    work = dist.all_gather_single(out, shard, async_op=True)
    storage, nbytes = out.untyped_storage(), out.untyped_storage().nbytes()
    storage.resize_(0)
    storage.resize_(nbytes)
    work.wait()


def correct_program() -> dict:
    """The same ingredients in a right order: side streams entered after the producer, waits
    on the compute stream, a wait on a side stream followed by ``record_stream``, events,
    FSDP-style hybrid (reduce-scatter, wait on the side stream, all-reduce behind it, hold
    the first buffers until the compute stream waits), and frees after all that."""
    rank, world = _world()
    compute, gather, reduce = API.current_stream(), API.Stream(), API.Stream()
    shard = torch.full((4,), float(rank))
    full = torch.empty(4 * world)
    gather.wait_stream(compute)
    with API.stream(gather):
        own = full.view(world, 4)[rank]
        own.copy_(shard)
        work = dist.all_gather_single(full, own, async_op=True)
    work.wait()
    grad = full * 2  # compute
    out = torch.empty(4)
    reduce.wait_stream(compute)
    with API.stream(reduce):
        rs = dist.reduce_scatter_single(out, grad, async_op=True)
        rs.wait()  # the reduce stream waits: the all-reduce is queued right behind
        ar = dist.all_reduce(out, async_op=True)
        done = reduce.record_event()
    held = (grad,)  # hold until the compute stream waits (rule 4)
    ar.wait()
    compute.wait_event(done)
    del held, grad
    total = out.sum()
    full.untyped_storage().resize_(0)  # after the compute stream waited for the gather
    scratch = torch.ones(8)
    reduce.wait_stream(compute)
    with API.stream(reduce):
        scratch.mul_(3)
        red = dist.all_reduce(scratch, async_op=True)
        red.wait()
    API.record_stream(scratch, reduce)  # freed on compute; reused only after reduce's work
    del scratch
    return {"total": float(total)}


MISUSES = {
    "missing wait_stream": ("misuse_missing_wait_stream", "read", "all_gather"),
    "wait on the wrong stream, then free": (
        "misuse_wait_on_wrong_stream_then_free",
        "free",
        "reduce_scatter",
    ),
    "read before wait": ("misuse_read_before_wait", "read", "all_reduce"),
    "functional read before wait": ("misuse_functional_read_before_wait", "read", "all_gather"),
    "compiled read before wait": ("misuse_compiled_read_before_wait", "read", "all_reduce"),
    "gather buffer reused while reduced": (
        "misuse_gather_buffer_reused_while_reduced",
        "write",
        "reduce_scatter",
    ),
    "resize_ in flight": ("misuse_resize_in_flight", "free", "all_gather"),
}


# ---- flatshard's device path -------------------------------------------------------------------
def hybrid_parity(name: str = "gpt_tied") -> dict:
    import nccl_slice

    return nccl_slice.nan_loud("nccl_slice", "parity", name, "hybrid_shard")


# ---- torch's FSDP2 ---------------------------------------------------------------------------
def fsdp2_parity(reshard: bool = True, steps: int = 3) -> dict:
    """torch's ``fully_shard`` on a CPU mesh of this group, 3 SGD steps of ``gpt_tied``
    against the single-process model on the global batch. On a CPU mesh FSDP2 takes its
    device handle from ``torch.cpu``, whose stream stubs the session stands in for: its
    all-gather copy-in and all-gather streams, its reduce-scatter stream, and its events run
    as virtual streams."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from parity_models import CASES, rel_err

    case, rank, world = CASES["gpt_tied"], dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = case.build()
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    loss_err = 0.0
    for step in range(steps):
        batch = case.batch(torch.Generator().manual_seed(step), 2 * world)
        loss = case.loss(model, batch.chunk(world)[rank])
        loss.backward()
        ref_loss = case.loss(ref, batch)
        ref_loss.backward()
        loss_err = max(loss_err, rel_err(_mean(loss, world), ref_loss.detach()))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    # Each rank's shard against its chunk of the reference (``full_tensor()`` would run a
    # functional collective, which this group refuses: it registers no C++ backend).
    mine = dict(model.named_parameters())
    sd_err = max(
        rel_err(mine[n].to_local(), p.detach().chunk(world)[rank])
        for n, p in ref.named_parameters()
        if p.detach().chunk(world)[rank].numel()
    )
    return {"loss_err": loss_err, "sd_err": sd_err}


def _mean(loss: torch.Tensor, world: int) -> torch.Tensor:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total / world


# ---- more of the device path: prefetch, pipeline, experts, compile, TP --------------------------
def nan_loud_slice(world: int, label: str):
    """The case of ``tests/nccl_slice.py``'s SLICE named ``label`` at ``world``, as its test
    runs it (NaN-loud errors)."""
    import nccl_slice

    spec = next(s for s in nccl_slice.SLICE if (s.world, s.label) == (world, label))
    _, module, function, args = spec.job("")
    return getattr(importlib.import_module(module), function)(*args)


def prefetch(forward: int, backward: str) -> dict:
    from test_engine_step import case_prefetch

    return case_prefetch(forward, backward)


def _strict_meshes(module):
    """``module``'s meshes made on this pool's backend (``strict_async``), not the
    Gloo groups it asks for, and made afresh (its cache is per worker)."""
    import contextlib

    from torch.distributed.device_mesh import init_device_mesh

    from patching import patched_attr

    def mesh(*args, backend_override=None, **kwargs):
        return init_device_mesh(*args, **kwargs)

    stack = contextlib.ExitStack()
    stack.enter_context(patched_attr(module, "init_device_mesh", mesh))
    return stack


def pipeline(schedule: str, per_rank: int) -> dict:
    """flatshard under torch's pipelining schedule (2 microbatches, SGD), as test_pipeline,
    its pp and dp meshes on this pool's backend."""
    import pipeline_cases

    spec = dict(schedule=schedule, microbatches=2, per_rank=per_rank, engine="flatshard",
                optim="sgd")  # fmt: skip
    pipeline_cases._MESHES.clear()
    try:
        with _strict_meshes(pipeline_cases):
            return {**spec, **pipeline_cases.case_schedules([spec])[0]}
    finally:
        pipeline_cases._MESHES.clear()


def experts(n_experts: int, top_k: int) -> dict:
    """Experts on their own mesh (test_expert_parallel at world 4: all-to-all dispatch over
    ``ep``, dense blocks sharded over all ranks, experts over ``efsdp``)."""
    import ep_cases

    ep_cases._MESH.clear()
    try:
        return ep_cases.run(n_experts, top_k)
    finally:
        ep_cases._MESH.clear()


def compiled(how: str) -> dict:
    """Compiled blocks (``aot_eager``) against eager, test_compile's composition ``how``."""
    from test_compile import case_compositions

    return case_compositions([(how, False)], "aot_eager")


def tensor_parallel(name: str) -> list[dict]:
    """One ``test_tensor_parallel`` case (float64, SGD, 3 steps against one process)."""
    from test_tensor_parallel import CASES
    from tp_cases import run_specs

    return run_specs([dict(CASES[name], name=name, engine="flatshard", optim="sgd")])


def context_parallel(cp: int, attention: str) -> dict:
    """Context parallelism (test_train_cp's library case, float64, SGD, 3 steps against one
    process): the ring's point-to-point hops or the all-gather on this pool's backend."""
    import cp_cases

    with _strict_meshes(cp_cases):
        return cp_cases.case_cp_matches_single_process("sgd", "float64", cp, attention)


# ---- mutants: flatshard with a stream rule broken ----------------------------------------------
def mutant_no_wait_stream() -> dict:
    """flatshard whose ``on_side_stream`` skips ``wait_stream``: the side stream would read the
    shard and write the buffers before the compute stream produced them."""
    from flatshard.core import gather, reduce, streams
    from patching import patched_attr

    def careless(s, kind):
        return s.use(s.side(kind))

    with (
        patched_attr(gather, "on_side_stream", careless),
        patched_attr(reduce, "on_side_stream", careless),
    ):
        assert streams.on_side_stream is not careless
        return hybrid_parity()


def mutant_drops_first_buffers() -> dict:
    """``then_issue`` as before the fix: the reduce-scatter's buffers dropped at its wait on
    the reduce side stream (hybrid_shard)."""
    from flatshard.comm import collectives
    from patching import patched_attr

    def then_issue(work, issue, group, timeout):
        if collectives.waits_on_host(group):
            work.add_then(lambda t: issue().wait(t))
            return
        work.wait(timeout)
        follow = issue()
        work.work, work.op, work.keep_alive = follow.work, follow.op, follow.keep_alive
        work.then = follow.then

    from flatshard.core import reduce

    with patched_attr(reduce, "then_issue", then_issue):
        return hybrid_parity()


# ---- the lists the tests run -------------------------------------------------------------------
# tests/nccl_slice.py's SLICE cases, run as they are there: world -> (labels, slow labels)
SLICE_LABELS = {
    2: (["full_shard gpt_tied", "shard_grad_op gpt_tied", "no_shard lora",
         "checkpoint_activations", "no_sync unsharded", "prefetch 2 post", "coalesce bf16",
         "bf16", "offload bf16"],
        ["full_shard unused", "reentrant", "fp16 GradScaler", "offload clip + optimizer state",
         "muon", "adafactor"]),
    3: ([], ["full_shard gpt_tied", "no_shard gpt_tied", "no_sync sharded", "coalesce unused",
             "offload fp32 lora", "muon plain", "adafactor max"]),
    4: (["hybrid gpt_tied", "hybrid no_sync"], []),
}  # fmt: skip
# FSDP x TP cases of test_tensor_parallel (dp2 x tp2), DTensor's redistributions carried by
# ``testing/functional_collectives.py``; the fast one above, these with FLATSHARD_SLOW=1
TP_SLOW = ("tp", "sp_shard_grad_op", "sp_checkpoint_fs", "sp_tied_lazy_root", "sp_meta_init")
EXTRA = [  # (world, label, function here, args, slow)
    (2, "prefetch 0", "prefetch", (0, "none"), True),
    (2, "prefetch 1 pre", "prefetch", (1, "pre"), True),
    (2, "prefetch 3 post", "prefetch", (3, "post"), True),
    (2, "fsdp2", "fsdp2_parity", (), False),
    (2, "fsdp2 keep after forward", "fsdp2_parity", (False,), True),
    (4, "pipeline 1F1B", "pipeline", ("1F1B", 1), True),
    (4, "pipeline ZBVZeroBubble", "pipeline", ("ZBVZeroBubble", 2), True),
    (4, "pipeline InterleavedZeroBubble", "pipeline", ("InterleavedZeroBubble", 2), True),
    (4, "experts on their own mesh", "experts", (4, 2), True),
    (4, "tp sp_loss_parallel", "tensor_parallel", ("sp_loss_parallel",), False),
    (2, "compiled block_forward", "compiled", ("block_forward",), False),
    (2, "compiled compile_after", "compiled", ("compile_after",), True),
    (2, "compiled wrap_before", "compiled", ("wrap_before",), True),
    *[(4, f"tp {name}", "tensor_parallel", (name,), True) for name in TP_SLOW],
    (4, "cp ring 4", "context_parallel", (4, "ring"), False),
    (4, "cp allgather 2", "context_parallel", (2, "allgather"), True),
]
