"""``torch.compile`` composes with flatshard, however it is applied (world 2, Gloo).

flatshard's hooks are never traced (see [Note: hooks the compiler never traces] in
``features/compile_boundary.py``), so:

* per block — ``block.compile(fullgraph=True)`` before or after ``fs.shard`` (torchtitan's
  order is before), ``torch.compile(block, fullgraph=True)`` put back in the parent, or
  ``block.forward = torch.compile(block.forward)`` — compiles with **zero graph breaks**;
* ``torch.compile(model)`` breaks the graph only at unit boundaries (the hooks), and Dynamo
  then compiles the blocks' forwards one by one.

Each case trains two sharded TinyGPTs from the same seed on the same data, one eager and one
compiled, forward + backward + AdamW, and compares losses, gradient fragments (every rank) and
the full state dicts (rank 0), and checks that parameter names and state-dict keys are the
plain model's. ``aot_eager`` runs the same ATen ops as eager: fp32 parity (observed:
bit-identical). Inductor fuses and reorders fp32 arithmetic: 1e-4 (observed ~1e-6); it needs a
C++ compiler on CPU and ~30 s of compiling, so it is marked slow. Several cases share one pool
job: each job costs a spawn-free round trip, but every case recompiles from scratch.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn

import flatshard as fs
from flatshard.features.compile_boundary import is_untraced, plain_name, register_plain_keys
from parity_models import Block, TinyGPT, _lm_loss, _tokens, named_param_groups, rel_err

STEPS = 3
# Six blocks, not three: with three, the gather pool's ping-pong happens to hand every block
# its forward buffer back, and a compiled graph that saved a parameter view without the
# saved-tensor hooks would still look right (docs/engine.md, "Full buffer lifetime").
LAYERS = 6
EAGER_TOLERANCE = 1e-5  # aot_eager: same kernels as eager
INDUCTOR_TOLERANCE = 1e-4  # fp32 inductor: fused kernels, other summation orders
# The four ways of compiling each block (and the older block.forward one): zero graph breaks.
PER_BLOCK = ("compile_before", "compile_after", "wrap_before", "wrap_after", "block_forward")


def _compile_blocks(model: nn.Module, how: str, backend: str) -> None:
    """Compile every block of ``model`` the way ``how`` names (fullgraph where it applies)."""
    for i, block in enumerate(list(model.blocks)):
        if how.startswith("compile"):  # in place: nn.Module.compile compiles _call_impl
            block.compile(fullgraph=True, backend=backend)
        elif how.startswith("wrap"):  # an OptimizedModule in the parent (names: _orig_mod.)
            model.blocks[i] = torch.compile(block, fullgraph=True, backend=backend)
        elif how == "block_forward":
            block.forward = torch.compile(block.forward, fullgraph=True, backend=backend)


def _build(how: str, backend: str, recompute: bool) -> nn.Module:
    """A sharded TinyGPT (seed 0, one unit per block), compiled as ``how`` says."""
    torch.manual_seed(0)
    model = TinyGPT(layers=LAYERS)
    if how.endswith("_before"):
        _compile_blocks(model, how, backend)
    model = fs.shard(model, policy=fs.wrap.by_type(Block))
    if not how.endswith("_before"):
        _compile_blocks(model, how, backend)
    if recompute:
        fs.checkpoint_activations(model, fs.wrap.by_type(Block))
    if how == "model":  # the whole model: Dynamo breaks the graph at the units' hooks
        return torch.compile(model, backend=backend)
    return model


def _grad_err(model: nn.Module, ref: nn.Module) -> float:
    """Largest relative error between the two models' gradient fragments on this rank."""
    worst = 0.0
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None and p.numel():
            worst = max(worst, rel_err(p.grad, q.grad))
    return worst


def _names_match(model: nn.Module, plain: nn.Module, how: str) -> bool:
    """Parameter names and state-dict keys are the plain (never compiled) model's. A wrapped
    block is an ``OptimizedModule`` in the tree: torch names its parameters ``_orig_mod.``,
    the state dict (and so every checkpoint) does not."""
    names = [n for n, _ in model.named_parameters()]
    if how.startswith("wrap"):
        names = [plain_name(n) for n in names]
    return names == [n for n, _ in plain.named_parameters()] and list(model.state_dict()) == list(
        plain.state_dict()
    )


def _train(eager: nn.Module, compiled: nn.Module) -> dict[str, float]:
    """``STEPS`` steps of both side by side; the worst loss and gradient errors on this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    plain = getattr(compiled, "_orig_mod", compiled)  # torch.compile(model) wraps the module
    opts = [torch.optim.AdamW(named_param_groups(m), lr=1e-3) for m in (eager, plain)]
    out = {"loss": 0.0, "grad": 0.0}
    for step in range(STEPS):
        batch = _tokens(torch.Generator().manual_seed(step), 2 * world).chunk(world)[rank]
        losses = []
        for model in (eager, compiled):
            loss = _lm_loss(model, batch)
            loss.backward()
            losses.append(loss.detach())
        out["loss"] = max(out["loss"], rel_err(losses[1], losses[0]))
        out["grad"] = max(out["grad"], _grad_err(plain, eager))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return out


def _compare(how: str, backend: str, recompute: bool) -> dict[str, float]:
    """Eager vs compiled sharded copies: errors, graph breaks and graphs, names, on this rank."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # the pool's workers are shared: start from no cached graphs
    counters.clear()
    eager, compiled = _build("eager", backend, recompute), _build(how, backend, recompute)
    out = _train(eager, compiled)
    out["breaks"] = float(sum(counters["graph_break"].values()))
    out["graphs"] = float(counters["stats"]["unique_graphs"])
    plain = getattr(compiled, "_orig_mod", compiled)
    torch.manual_seed(0)
    out["names"] = float(_names_match(plain, TinyGPT(layers=LAYERS), how))
    out["units"] = float(len(fs.units(plain)))
    hooks = [
        h
        for m in plain.modules()
        for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())
    ]
    out["untraced"] = float(bool(hooks) and all(is_untraced(h) for h in hooks))
    full, ref = fs.full_state_dict(plain), fs.full_state_dict(eager)
    out["params"] = 0.0
    if dist.get_rank() == 0:
        assert list(full) == list(ref), f"{how}: compiling changed the full state dict's keys"
        out["params"] = max(rel_err(full[k], ref[k]) for k in ref)
    torch._dynamo.reset()
    return out


def case_compositions(runs: list[tuple[str, bool]], backend: str) -> dict[str, dict]:
    """Every ``(how, recompute)`` of ``runs`` in one pool job (compiling dominates the cost)."""
    torch._inductor.config.compile_threads = 1  # no compile subprocesses inside pool workers
    return {f"{how}{'+ckpt' if rc else ''}": _compare(how, backend, rc) for how, rc in runs}


def _check(results: list[dict[str, dict]], tolerance: float) -> None:
    for rank, by_case in enumerate(results):
        for case, r in by_case.items():
            for key in ("loss", "grad", "params"):
                err = r[key]
                assert err <= tolerance, (
                    f"rank {rank} {case}: {key} rel err {err:.2e} > {tolerance}"
                )
            assert r["graphs"] >= 1, f"rank {rank} {case}: nothing was compiled"
            assert r["names"] == 1.0, f"rank {rank} {case}: parameter names or keys changed"
            assert r["untraced"] == 1.0, f"rank {rank} {case}: a hook Dynamo would trace"


def _check_no_breaks(results: list[dict[str, dict]]) -> None:
    for rank, by_case in enumerate(results):
        for case, r in by_case.items():
            assert r["breaks"] == 0, f"rank {rank} {case}: {r['breaks']:.0f} graph breaks"
            # One graph for all the blocks (same code, parameters are graph inputs).
            assert r["graphs"] == 1, f"rank {rank} {case}: {r['graphs']:.0f} graphs, not 1"


def test_per_block_fullgraph_has_no_graph_break_and_matches_eager(dist_pools):
    """Every per-block composition, fullgraph=True, before and after fs.shard (aot_eager)."""
    runs = [(how, False) for how in PER_BLOCK]
    results = dist_pools(2).run(case_compositions, runs, "aot_eager")
    _check(results, EAGER_TOLERANCE)
    _check_no_breaks(results)


def test_per_block_fullgraph_with_activation_checkpointing(dist_pools):
    """fs.checkpoint_activations on compiled blocks: recomputation inside the compiled graph."""
    runs = [("compile_before", True), ("block_forward", True)]
    results = dist_pools(2).run(case_compositions, runs, "aot_eager")
    _check(results, EAGER_TOLERANCE)
    _check_no_breaks(results)


def test_whole_model_breaks_only_at_unit_boundaries(dist_pools):
    """torch.compile(model): exact, and the graph breaks only where a unit's hook runs
    (observed: 2 breaks, 3 graphs; with traced hooks it was ~50; see docs/compile.md)."""
    results = dist_pools(2).run(case_compositions, [("model", False)], "aot_eager")
    _check(results, EAGER_TOLERANCE)
    for rank, by_case in enumerate(results):
        r = by_case["model"]
        boundaries = 2 * r["units"]  # each unit's pre- and post-forward hook
        assert r["breaks"] <= boundaries, (
            f"rank {rank}: {r['breaks']:.0f} graph breaks > {boundaries:.0f} unit boundaries "
            f"({r['graphs']:.0f} graphs)"
        )


def test_plain_state_dict_keys_of_compiled_children():
    """The root's state-dict hooks: plain keys out, plain (or compiled) keys back in."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 2)))
    plain_keys = list(model.state_dict())
    model[1] = torch.compile(model[1])  # (nothing compiles until it is called)
    assert any("_orig_mod" in k for k in model.state_dict())
    register_plain_keys(model)
    sd = model.state_dict()
    assert list(sd) == plain_keys
    new = {k: torch.full_like(v, 7.0) for k, v in sd.items()}
    assert not model.load_state_dict(new).missing_keys
    assert all(bool((v == 7).all()) for v in model.state_dict().values())
    assert plain_name("blocks.0._orig_mod.mlp.fc.weight") == "blocks.0.mlp.fc.weight"


def _cxx_compiler() -> str | None:
    return next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)


@pytest.mark.slow
@pytest.mark.skipif(
    _cxx_compiler() is None,
    reason="inductor on CPU needs a C++ compiler (g++/c++/clang++ not on PATH); the "
    "aot_eager tests above still check the composition",
)
def test_inductor_block_compile_fullgraph_matches_eager(dist_pools):
    """torchtitan's order with inductor: block.compile(fullgraph=True), then fs.shard (~30 s
    of compiling on 2 cores with a cold cache)."""
    results = dist_pools(2).run(case_compositions, [("compile_before", False)], "inductor")
    _check(results, INDUCTOR_TOLERANCE)
    _check_no_breaks(results)
