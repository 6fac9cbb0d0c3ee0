"""The world-1 checks of ``bench/gpu_check.py`` (GPT "small" in fp32 on a GPU, "tiny" in the
dry run), in two passes: ``plain`` (world 1 as a user gets it: no collective at all) and
``forced`` (the size-one group kept, ``gpu_check_forced.forced_groups``: real all-gathers,
reduce-scatters and all-reduces; each check must also have issued them). The activation-
checkpointing routes are ``gpu_check_routes.py``; docs/performance.md ("GPU check") says what
each check asserts.
"""

from __future__ import annotations

import math
import os
import tempfile

import torch
from gpu_check_common import TOL, Ctx, lm_loss, rel_err, run_checks, step_parity, train
from gpu_check_forced import Spy, forced_groups
from gpu_check_routes import ROUTE_CHECKS

import flatshard as fs
from flatshard.models import GPT, Block


def check_fp32_parity(c: Ctx) -> dict:
    return step_parity(c.sharded(), c.ref(), c.x, c.x2)


def check_bf16_mixed(c: Ctx) -> dict:
    mp = fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = c.sharded(mixed_precision=mp)
    losses = train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), c.x, c.x2, c.x)
    with torch.no_grad():
        fp32 = lm_loss(c.ref(), c.x).item()
    fp32_frags = all(p.dtype == torch.float32 for p in model.parameters())
    ok = all(math.isfinite(v) for v in losses) and fp32_frags
    ok &= abs(losses[0] - fp32) <= 0.02 * abs(fp32)  # bf16 forward ~ fp32 forward
    return {"ok": ok, "losses": losses, "fp32_loss": fp32, "fp32_fragments": fp32_frags}


def check_cpu_offload(c: Ctx) -> dict:
    model = c.sharded(offload=fs.CPUOffload(params=True))
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    pinned = all(p.is_pinned() for p in model.parameters()) if c.cuda else None  # CUDA only
    out = step_parity(model, c.ref(), c.x, c.x2)
    out.update(on_cpu=on_cpu, pinned=pinned, ok=out["ok"] and on_cpu and pinned is not False)
    return out


def check_pooled_buffers(c: Ctx) -> dict:
    """Reused gather buffers + saved-view hooks on the device: with offloaded shards the full
    buffers are separate tensors even at world 1, so the pool serves them; 3 SGD steps, the
    gradients of each equal the unsharded model's (from step 2 on a block's backward regather
    lands in another buffer than its forward's)."""
    model, ref = c.sharded(offload=fs.CPUOffload(params=True)), c.ref()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
    errs = []
    for x in (c.x, c.x2, c.x):
        lm_loss(model, x).backward(), lm_loss(ref, x).backward()
        errs.append(max(rel_err(params[n].grad, q.grad.reshape(-1)) for n, q in ref_params.items()))
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    allocations = fs.memory_stats(model).pool_allocations
    # CPU dry run: offloading to the CPU is a no-op there, so world 1 has no buffer to pool.
    pooled = allocations > 0 or not c.cuda
    return {"ok": max(errs) <= TOL and pooled, "grad_errs": errs, "buffers": allocations}


def check_save_load(c: Ctx) -> dict:
    """Save after a step; load into another init that has optimizer state of its own."""
    model = c.sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, c.x)
    torch.manual_seed(1)
    other = fs.shard(GPT(c.cfg), policy=fs.wrap.by_type(Block))
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    train(other, other_opt, c.x2)
    with tempfile.TemporaryDirectory() as tmp:
        fs.save(os.path.join(tmp, "ckpt"), model=model, optimizer=opt, extra={"step": 1})
        extra = fs.load(os.path.join(tmp, "ckpt"), model=other, optimizer=other_opt)
    a, b = fs.full_state_dict(model), fs.full_state_dict(other)
    sd_diff = max((a[k] - b[k]).abs().max().item() for k in a)
    mine, theirs = (o.state_dict()["state"].values() for o in (opt, other_opt))
    pairs = [(s[k], t[k]) for s, t in zip(mine, theirs, strict=True) for k in s]
    opt_diff = max((s.float() - t.float()).abs().max().item() for s, t in pairs)
    with torch.no_grad():
        losses = [lm_loss(m, c.x2).item() for m in (model, other)]
    ok = sd_diff == 0 and opt_diff == 0 and extra.get("step") == 1 and losses[0] == losses[1]
    return {"ok": ok, "state_dict_diff": sd_diff, "optimizer_diff": opt_diff, "losses": losses}


def check_activation_ckpt(c: Ctx) -> dict:
    model = c.sharded()
    fs.checkpoint_activations(model, fs.wrap.by_type(Block))
    return step_parity(model, c.ref(), c.x, c.x2)


def check_meta_init(c: Ctx) -> dict:
    with torch.device("meta"):
        model = GPT(c.cfg)
    model = fs.shard(model, policy=fs.wrap.by_type(Block))
    tensors = [*model.parameters(), *model.buffers()]
    placed = all(t.device.type == c.device.type for t in tensors)
    finite = all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())
    losses = train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), c.x, c.x2)
    uniform = math.log(c.cfg.vocab_size)  # a small-init GPT starts near the uniform loss
    ok = placed and finite and abs(losses[0] - uniform) < 0.1 * uniform and losses[1] < 1e9
    return {"ok": ok, "on_device": placed, "finite": finite, "losses": losses, "ln_V": uniform}


CHECKS = [check_fp32_parity, check_bf16_mixed, check_cpu_offload, check_pooled_buffers]
CHECKS += [check_save_load]
CHECKS += [check_activation_ckpt, *ROUTE_CHECKS, check_meta_init]


def _forced(fn):
    """``fn`` under ``forced_groups``; it must also have issued gathers and reductions."""

    def check(c: Ctx) -> dict:
        with forced_groups(), Spy() as spy:
            r = fn(c)
        if "skipped" not in r:
            r["collectives"], r["issued"] = spy.summary(), spy.issued(c.device.type)
            r["ok"] = bool(r["ok"]) and r["issued"]
        return r

    check.__name__ = fn.__name__
    return check


def checks_pass(c: Ctx, forced: bool) -> dict:
    """Every check of ``CHECKS``, plain or forced: name -> result (``run_checks``)."""
    return run_checks([_forced(fn) for fn in CHECKS] if forced else CHECKS, c)
