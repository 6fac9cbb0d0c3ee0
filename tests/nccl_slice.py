"""The slice of the parity suite that test_nccl_semantics runs under ``strict_async``.

Each ``Spec`` names an existing case function (run on every rank, as in its own test module)
and the check its test applies; ``case_*`` here are the cases no other module has: offload with
``fs.clip_grad_norm_`` and optimizer-state save/load, the offload device contract (under
``flatshard.testing.virtual_device``) and a flatshard mutant that skips a gather's wait.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

import flatshard as fs
import parity_models
from flatshard.api import get_state
from flatshard.testing import nccl_semantics as ns
from flatshard.testing.virtual_device import COMPUTE, VirtualDevice
from parity_models import CASES, check_parity, mesh_for, named_param_groups, train_parity
from patching import patched_attr

_REL_ERR = parity_models.rel_err


def _loud_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    err = _REL_ERR(a, b)
    return err if math.isfinite(err) else math.inf


def nan_loud(module: str, name: str, *args):
    """``module.name(*args)`` with a NaN-loud ``rel_err``: the parity harness folds errors with
    ``max(worst, err)``, and ``max(0.0, nan)`` is 0.0, so a run that computed with NaN (a
    read before ``wait()`` here) would pass. Infinity survives ``max``."""
    import whole_param_parity

    target = importlib.import_module(module)
    with contextlib.ExitStack() as stack:
        for m in {parity_models, whole_param_parity, target}:
            if hasattr(m, "rel_err"):
                stack.enter_context(patched_attr(m, "rel_err", _loud_rel_err))
        return getattr(target, name)(*args)


def parity(name: str, strategy: str = "full_shard", recompute=False, micro: int = 1) -> dict:
    return train_parity(name, 5, 2, strategy, recompute, micro_batches=micro)


def whole_param(label: str, name: str, strategy: str) -> dict:
    from test_optim_whole_param import RUNS
    from whole_param_parity import optimizer_parity

    make, make_ref, select, handoff = RUNS[label]
    return optimizer_parity(name, strategy, make, make_ref, select=select, handoff=handoff)


def case_offload_clip_osd() -> dict:
    """Offloaded ``unused`` (AdamW: no noise floor there) with ``fs.clip_grad_norm_`` against
    torch's on the global batch; then the full optimizer state against the reference's, and a
    fresh offloaded copy loaded from it against the trained one."""
    case, world, rank = CASES["unused"], dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    ref = case.build()
    model = fs.shard(copy.deepcopy(ref), policy=case.policy(), offload=fs.CPUOffload())
    opt = torch.optim.AdamW(named_param_groups(model), lr=1e-2)
    ref_opt = torch.optim.AdamW(named_param_groups(ref), lr=1e-2)
    norm_err = 0.0
    for step in range(3):
        batch = case.batch(torch.Generator().manual_seed(step), 2 * world)
        case.loss(model, batch.chunk(world)[rank]).backward()
        case.loss(ref, batch).backward()
        norm = fs.clip_grad_norm_(model, 0.05)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        norm_err = max(norm_err, _loud_rel_err(norm, ref_norm))
        for o in (opt, ref_opt):
            o.step(), o.zero_grad()
    osd = fs.full_optimizer_state_dict(model, opt)
    fresh = fs.shard(copy.deepcopy(ref), policy=case.policy(), offload=fs.CPUOffload())
    fresh_opt = torch.optim.AdamW(named_param_groups(fresh), lr=1.0)
    fs.load_full_optimizer_state_dict(fresh, fresh_opt, osd)
    return {
        "norm_err": norm_err,
        "sd_err": parity_models.state_dict_err(model, ref),
        "osd_err": _osd_err(osd, ref, ref_opt) if rank == 0 else 0.0,
        "phantom": sorted(n for n, s in osd.get("state", {}).items() if "step" not in s),
        "reload_equal": _same_state(model, opt, fresh, fresh_opt),
        "lr": [g["lr"] for g in fresh_opt.param_groups],
    }


def _osd_err(osd: dict, ref, ref_opt) -> float:
    """Against the reference's state, for the parameters it has state for (the others are
    ``phantom`` above)."""
    worst = 0.0
    for name, p in ref.named_parameters():
        for key, value in ref_opt.state.get(p, {}).items():
            worst = max(worst, _loud_rel_err(torch.as_tensor(osd["state"][name][key]), value))
    return worst


def _same_state(model, opt, fresh, fresh_opt) -> bool:
    """The loaded copy holds the trained one's state, for every parameter that has one."""
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        mine, theirs = opt.state.get(a, {}), fresh_opt.state.get(b, {})
        if mine and not all(torch.equal(torch.as_tensor(v), theirs[k]) for k, v in mine.items()):
            return False
    return True


def case_offload_devices(name: str, extra: str, offload: bool = True) -> dict:
    """3 steps of ``name`` (AdamW; ``extra``: Adafactor, bf16 compute, ``fs.GradScaler``,
    ``fs.clip_grad_norm_``, or a full optimizer-state save and load after them) under the
    virtual compute device: every tensor handed to a collective must be a compute-device
    tensor (a violation otherwise), and no op may mix host and compute tensors."""
    from flatshard.core import mesh

    case, device = CASES[name], VirtualDevice()
    world, rank = dist.get_world_size(), dist.get_rank()
    ns.add_tensor_check(device.host_collective_check)
    try:
        with patched_attr(mesh, "compute_device", lambda group: COMPUTE), device:
            torch.manual_seed(0)
            offloaded = fs.CPUOffload() if offload else None
            bf16 = fs.MixedPrecision(param_dtype=torch.bfloat16) if extra == "bf16" else None
            model = fs.shard(case.build(), policy=case.policy(), offload=offloaded,
                             mixed_precision=bf16)  # fmt: skip
            opt = (fs.optim.Adafactor if extra == "adafactor" else torch.optim.AdamW)(
                model.parameters(), lr=1e-2
            )
            scaler = fs.GradScaler() if extra == "scaler" else None
            for step in range(3):
                batch = case.batch(torch.Generator().manual_seed(step), 2 * world)
                loss = case.loss(model, batch.chunk(world)[rank].to(COMPUTE))
                (scaler.scale(loss) if scaler else loss).backward()
                if extra == "clip":
                    fs.clip_grad_norm_(model, 1.0)
                scaler.step(opt) if scaler else opt.step()
                scaler.update() if scaler else None
                opt.zero_grad()
            if extra == "osd":
                fs.load_full_optimizer_state_dict(
                    model, opt, fs.full_optimizer_state_dict(model, opt)
                )
            fs.full_state_dict(model)
    finally:
        ns.remove_tensor_check(device.host_collective_check)
    return {"mixed": sorted(set(device.mixed)), "units": len(get_state(model).units)}


def case_steady_syncs(name: str, strategy: str, optimizer: str) -> dict:
    """The device syncs flatshard's own code makes in a steady step (the third), under the
    virtual compute device: host reads of compute tensors (``.item()``, ``.tolist()``,
    ``bool()``, ``.cpu()``). Each one drains the device on CUDA."""
    from flatshard.core import mesh

    case, device = CASES[name], VirtualDevice()
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh_arg = mesh_for(strategy)
    with patched_attr(mesh, "compute_device", lambda group: COMPUTE), device:
        torch.manual_seed(0)
        model = fs.shard(case.build(), policy=case.policy(), strategy=strategy, mesh=mesh_arg)
        make = fs.optim.Adafactor if optimizer == "adafactor" else torch.optim.AdamW
        opt = make(model.parameters(), lr=1e-2)
        for step in range(3):
            device.syncs.clear()  # the last step's count is what remains
            batch = case.batch(torch.Generator().manual_seed(step), 2 * world)
            case.loss(model, batch.chunk(world)[rank].to(COMPUTE)).backward()
            opt.step()
            opt.zero_grad()
    return {"syncs": list(device.syncs)}


def case_flatshard_skips_a_gather_wait() -> dict:
    """A mutant flatshard whose ``PendingWork.wait`` returns at once for all-gathers (waited
    only after training): under NCCL it reads the gathered parameters before they arrive."""
    from flatshard.comm.collectives import PendingWork

    skipped, wait = [], PendingWork.wait

    def skip(self, timeout):
        if self.op == "all_gather" and self.work is not None:
            skipped.append(self.work)
            self.work = None
        wait(self, timeout)

    try:
        with patched_attr(PendingWork, "wait", skip):
            return nan_loud("nccl_slice", "parity", "gpt_tied")
    finally:
        for work in skipped:
            work.wait()


# ---- checks (those of each case's own test) ------------------------------------------------------
def _finite(value) -> bool:
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    return not isinstance(value, float) or math.isfinite(value)


def _parity(results: list, label: str) -> None:
    check_parity(results, label)


def _err(results: list, label: str) -> None:
    assert results[0]["err"] <= 1e-5, (label, results[0])


def _prefetched(results: list, label: str) -> None:
    assert all(r["err"] <= 1e-5 and r["gathered_at_block0"] == 4 for r in results), results


def _bitwise(results: list, label: str) -> None:
    assert all((r["grad"], r["param"], r["loss"]) == (0.0, 0.0, 0.0) for r in results), label
    assert results[0]["buckets"], f"{label}: no bucket was formed"


def _rounding(results: list, label: str) -> None:
    """Coalesced vs not at world >= 3 off Gloo's point-to-point ring: the backend's own
    reduce-scatter (Gloo's here, NCCL's ring on a GPU) adds a chunk's contributions in an
    order that depends on where the chunk sits in the buffer, so a bucket rounds differently
    from its units alone (measured 3.7e-9 on gradients of ~1e-1)."""
    assert all(max(r["grad"], r["param"], r["loss"]) <= 1e-6 for r in results), (label, results)
    assert results[0]["buckets"], f"{label}: no bucket was formed"


def _curve(results: list, label: str) -> None:
    assert results[0]["loss_rel"] <= 0.02 and results[0]["master_fp32"], (label, results[0])


def _fp16(results: list, label: str) -> None:
    assert all(r["finite"] and r["err"] <= 1e-3 for r in results), (label, results)


def _amp(results: list, label: str) -> None:
    for r in results:
        assert r["scale"] == r["ref_scale"] == [256, 512, 512, 256, 256, 512], r
        assert all(abs(a / b - 1) < 1e-3 for a, b in zip(r["loss"], r["ref_loss"], strict=True))


def _overflow(results: list, label: str) -> None:
    for r in results:
        assert r["skipped"] == [False, True, False] and r["changed"] == [True, False, True], r


def _offload(results: list, label: str) -> None:
    assert all(r["err"] == 0.0 and r["on_cpu"] and r["h2d"] > 0 for r in results), results


def _clip_osd(results: list, label: str) -> None:
    r = results[0]
    assert max(r["norm_err"], r["sd_err"], r["osd_err"]) <= 1e-5, (label, r)
    assert all(x["reload_equal"] and x["lr"] == [1e-2, 1e-2] for x in results), results


def _no_phantom_state(results: list, label: str) -> None:
    assert results[0]["phantom"] == [], f"{label}: state without 'step' {results[0]['phantom']}"


def _whole(results: list, label: str) -> None:
    grad = max(r["grad_err"] for r in results)
    assert max(results[0]["sd_err"], results[0]["state_err"], grad) <= 1e-5, (label, results)


def _resumed(results: list, label: str) -> None:
    assert all(r["state_err"] <= 1e-5 and r["loss_err"] <= 1e-5 for r in results), results
    assert results[0]["sd_err"] <= 1e-5 and results[0]["noisy_fraction"] < 0.01, results[0]


def _devices(results: list, label: str) -> None:
    assert all(r["mixed"] == [] for r in results), results  # ops CUDA would refuse


def _no_syncs(results: list, label: str) -> None:
    # Before session 9: the usage flags' .cpu() at every end of backward (1 per step).
    assert all(r["syncs"] == [] for r in results), (label, results)


def _adafactor_syncs(results: list, label: str) -> None:
    # Two reads per step (its step-size scalars, the update norms), whatever the number of
    # parameters; before session 9 one .item() per parameter besides (4 more here).
    assert all(len(r["syncs"]) <= 2 for r in results), (label, results)


def _ran(results: list, label: str) -> None:
    pass


@dataclass(frozen=True)
class Spec:
    world: int
    label: str
    check: Callable[[list, str], None]
    target: str  # "module:function", run on every rank
    args: tuple
    xfail: str = ""  # a known flatshard defect: the reason names it (strict: fixed = noticed)

    def job(self, ckpt: str) -> tuple:
        args = tuple(ckpt if a == "<ckpt>" else a for a in self.args)
        return (self.label, "nccl_slice", "nan_loud", (*self.target.split(":"), *args))

    def checked(self, results: list) -> None:
        assert _finite(results), f"{self.label}: a NaN/inf result {results}"
        self.check(results, f"{self.label} at world {self.world}")

    def param(self):
        marks = [pytest.mark.xfail(strict=True, reason=self.xfail)] if self.xfail else []
        return pytest.param(self, id=f"{self.label}-w{self.world}", marks=marks)


def spec(world: int, label: str, check: Callable, target: str, *args, xfail: str = "") -> Spec:
    return Spec(world, label, check, target if ":" in target else f"nccl_slice:{target}", args,
                xfail)  # fmt: skip


PRECISION, STEP, SCALER = "test_precision:", "test_engine_step:", "test_grad_scaler:"
COALESCE, RESHARD = "test_coalesce:case_identical", "test_checkpoint_reshard:"
SLICE = [
    spec(2, "full_shard gpt_tied", _parity, "parity", "gpt_tied"),
    spec(2, "full_shard unused", _parity, "parity", "unused"),
    spec(2, "full_shard reused_unit", _parity, "parity", "reused_unit"),
    spec(2, "shard_grad_op gpt_tied", _parity, "parity", "gpt_tied", "shard_grad_op"),
    spec(2, "no_shard lora", _parity, "parity", "lora", "no_shard"),
    spec(2, "checkpoint_activations", _parity, "parity", "gpt_nested_units", "full_shard", True),
    spec(2, "reentrant", _parity, "parity", "gpt_tied", "full_shard", "around_reentrant"),
    spec(2, "no_sync unsharded", _parity, "parity", "gpt_tied", "full_shard", False, 2),
    spec(2, "prefetch 2 post", _prefetched, STEP + "case_prefetch", 2, "post"),
    spec(2, "coalesce bf16", _bitwise, COALESCE, "gpt_tied", "full_shard", "none", True),
    spec(2, "bf16", _curve, PRECISION + "case_loss_curve", "gpt_tied", "bf16", "fp32", "no_shard"),
    spec(2, "fp16 GradScaler", _amp, SCALER + "case_parity_with_torch_amp"),
    spec(2, "fp16 overflow", _overflow, SCALER + "case_one_rank_overflows", "full_shard", math.inf),
    spec(2, "offload bf16", _offload, PRECISION + "case_offload_parity", "gpt_tied", True),
    spec(2, "offload clip + optimizer state", _clip_osd, "case_offload_clip_osd"),
    spec(2, "optimizer state of unused params", _no_phantom_state, "case_offload_clip_osd"),
    spec(2, "muon", _whole, "whole_param", "muon", "gpt_tied", "full_shard"),
    spec(2, "adafactor", _whole, "whole_param", "adafactor", "unused", "shard_grad_op"),
    spec(2, "checkpoint save", _ran, RESHARD + "case_save", "<ckpt>"),
    spec(2, "devices: offload training", _devices, "case_offload_devices", "unused", "none"),
    spec(2, "devices: offload clip", _devices, "case_offload_devices", "unused", "clip"),
    spec(2, "devices: offload optimizer state", _devices, "case_offload_devices", "lora", "osd"),
    spec(2, "devices: offload adafactor", _devices, "case_offload_devices", "unused", "adafactor"),
    spec(2, "devices: offload GradScaler", _devices, "case_offload_devices", "unused", "scaler"),
    spec(2, "devices: no offload", _devices, "case_offload_devices", "lora", "osd", False),
    spec(3, "devices: offload bf16", _devices, "case_offload_devices", "lora", "bf16"),
    spec(2, "syncs: steady step", _no_syncs, "case_steady_syncs", "gpt_tied", "full_shard",
         "adamw"),
    spec(4, "syncs: steady step hybrid", _no_syncs, "case_steady_syncs", "gpt_tied",
         "hybrid_shard", "adamw"),
    spec(2, "syncs: adafactor", _adafactor_syncs, "case_steady_syncs", "unused", "full_shard",
         "adafactor"),
    spec(3, "full_shard gpt_tied", _parity, "parity", "gpt_tied"),
    spec(3, "shard_grad_op unused", _parity, "parity", "unused", "shard_grad_op"),
    spec(3, "no_shard gpt_tied", _parity, "parity", "gpt_tied", "no_shard"),
    spec(3, "reentrant parts", _parity, "parity", "gpt_tied", "shard_grad_op", "inside_reentrant"),
    spec(3, "no_sync sharded", _err, STEP + "case_no_sync", "sharded", "full_shard"),
    spec(3, "coalesce unused", _rounding, COALESCE, "unused", "full_shard"),
    spec(3, "fp16 reduce", _fp16, PRECISION + "case_fp16_reduce", 2e4),
    spec(3, "fp16 GradScaler", _amp, SCALER + "case_parity_with_torch_amp"),
    spec(3, "offload fp32 lora", _offload, PRECISION + "case_offload_parity", "lora", False),
    spec(3, "offload clip + optimizer state", _clip_osd, "case_offload_clip_osd"),
    spec(3, "muon plain", _whole, "whole_param", "muon_plain", "gpt_tied", "full_shard"),
    spec(3, "adafactor max", _whole, "whole_param", "adafactor_max", "gpt_tied", "full_shard"),
    spec(3, "checkpoint resume", _resumed, RESHARD + "case_resume", "<ckpt>", "by_size"),
    spec(4, "hybrid gpt_tied", _parity, "parity", "gpt_tied", "hybrid_shard"),
    spec(4, "hybrid no_sync", _err, STEP + "case_no_sync", "unsharded", "hybrid_shard"),
]  # fmt: skip
