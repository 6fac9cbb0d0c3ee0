"""Per-block ``torch.compile`` with tensor parallelism: the cases behind
tests/test_tensor_parallel_compile.py.

World 4 = dp 2 x tp 2. The model, plans, data and reference are tests/tp_cases.py's (a tiny
transformer made tensor-parallel with torchtitan's llama plan, float64, SGD with momentum,
gradient clipping, 3 steps, against one process on the global batch). Here each block is
compiled (``aot_eager``) the way ``how`` says, before or after the engine shards the model:

* ``before`` / ``after``: ``block.compile(fullgraph=...)`` (torchtitan's order is TP plan,
  compile, then sharding);
* ``wrap_before``: ``model.blocks[i] = torch.compile(block, ...)`` (an ``OptimizedModule``
  in the tree), before ``fs.shard``;
* ``body_before``: the block's body compiled (``block._body``), so that the block's own
  ``torch.utils.checkpoint`` (spec ``ac``) runs eagerly around the compiled frame.

Other spec keys: ``ac`` (the blocks checkpoint their body: ``reentrant``/``non_reentrant``),
``fs_ckpt`` (``fs.checkpoint_activations`` after sharding), ``settle`` (FSDP2 only:
flatshard's settling pre-hook registered on its blocks by hand).

Engines: ``flatshard`` and ``fsdp2`` (the control, compiled before ``fully_shard``).
Reported per rank: the full state dict's worst relative error and its key, the gradient
norm's worst error, Dynamo's graph breaks and graphs. ``async_probe`` is the torch-only
problem of [Note: async tensors at a compiled unit's door] (compile_boundary.py), measured.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import flatshard as fs
import tp_cases as T


def _compile_blocks(model: torch.nn.Module, how: str, fullgraph: bool) -> None:
    for i, block in enumerate(list(model.blocks)):
        if how == "body_before":  # the checkpointed body compiled, the checkpoint eager
            block._body = torch.compile(block._body, backend="aot_eager", fullgraph=fullgraph)
        elif how == "wrap_before":
            model.blocks[i] = torch.compile(block, backend="aot_eager", fullgraph=fullgraph)
        else:
            block.compile(backend="aot_eager", fullgraph=fullgraph)


def _state_errors(model: torch.nn.Module, ref: torch.nn.Module, engine: str) -> tuple:
    """(worst relative error, its key) of the full state dict; (0, "") where not held."""
    state, ref_state = T._full_state(model, engine), ref.state_dict()
    if not state:
        return 0.0, ""
    errs = {k: T.rel_err(state[k], ref_state[k]) for k in ref_state}
    key = max(errs, key=errs.__getitem__)
    return errs[key], key


def train(spec: dict) -> dict:
    """One spec on this rank (see the module docstring)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # the pool's workers are shared: no graphs of an earlier case
    counters.clear()
    mesh, tp_mesh, dp_mesh, dp_size, dp_index = T._meshes(False)
    ref = T.build().to(torch.float64)
    model = copy.deepcopy(ref)
    T.parallelize(model, tp_mesh, sp=spec["sp"], loss_par=False)
    for block in [*model.blocks, *ref.blocks]:
        block.checkpointed = spec.get("ac", "")  # torch's checkpoint inside Block.forward
    how, fullgraph = spec["how"], spec.get("fullgraph", True)
    if how != "after":
        _compile_blocks(model, how, fullgraph)
    if spec.get("settle"):  # flatshard's fix, lent to FSDP2 by hand
        from flatshard.features.compile_boundary import register_settling

        register_settling(list(model.blocks))
    T._shard(model, spec, mesh, dp_mesh)
    if how == "after":
        _compile_blocks(model, how, fullgraph)
    if spec.get("fs_ckpt"):
        fs.checkpoint_activations(model, fs.wrap.by_type(T.Block))
    opt, ref_opt = T.OPTIMIZERS["sgd"](model.parameters()), T.OPTIMIZERS["sgd"](ref.parameters())
    norm_err = 0.0
    for step in range(T.STEPS):
        tokens, target = T.global_batch(step, dp_size)
        mine = slice(dp_index * T.ROWS, (dp_index + 1) * T.ROWS)
        T.loss_of(model, tokens[mine], target[mine], False)
        norm = T._clip(model, spec["engine"], T.MAX_NORM)
        opt.step()
        opt.zero_grad()
        T.loss_of(ref, tokens, target, False)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), T.MAX_NORM).item()
        ref_opt.step()
        ref_opt.zero_grad()
        norm_err = max(norm_err, abs(norm - ref_norm) / ref_norm)
    err, key = _state_errors(model, ref, spec["engine"])
    out = {"err": err, "key": key, "norm_err": norm_err}
    out["breaks"] = sum(counters["graph_break"].values())
    out["graphs"] = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return out


def run_specs(specs: list[dict]) -> list[dict]:
    """Every spec in order; a spec that raises reports its error (the others still run)."""
    out = []
    for spec in specs:
        try:
            out.append(train(spec))
        except Exception as exc:  # reported, never re-raised: the pool keeps its workers
            out.append({"error": f"{type(exc).__name__}: {exc}"})
        dist.barrier()
    return out


def async_probe() -> dict[str, bool]:
    """Torch alone, no flatshard: does a compiled function's output require grad when its
    input is ``redistribute(..., async_op=True).to_local()`` (an AsyncCollectiveTensor, what
    every ParallelStyle hands on)? And once settled by flatshard's ``_Settled``?"""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from flatshard.features.compile_boundary import _Settled

    mesh = T.mesh_of((2, 2), ("dp", "tp"))["tp"]
    torch._dynamo.reset()
    fn = torch.compile(lambda t: (t * t).sum(), backend="aot_eager", fullgraph=True)
    out = {}
    for name, settle in (("raw", False), ("settled", True)):
        leaf = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
        x = DTensor.from_local(leaf, mesh, [Partial()])
        x = x.redistribute(mesh, [Replicate()], async_op=True).to_local()
        if settle:
            x = _Settled.apply(x)
        loss = fn(x)
        out[name] = loss.requires_grad
        if loss.requires_grad:
            loss.backward()  # d/dleaf of (sum over tp of leaf)^2: 2 * tp * 1, every element
            out[f"{name}_grad_ok"] = bool((leaf.grad == 4.0).all())
    torch._dynamo.reset()
    return out
