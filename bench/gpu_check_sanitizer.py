"""The hybrid_shard and CPU-offload cases under torch's CUDA sanitizer, for gpu_check.sh.

Why a process of its own: ``TORCH_CUDA_SANITIZER=1`` must be set before torch is imported
(``import torch`` enables it), and it slows every kernel launch, so the main check must not
run under it. gpu_check.sh runs this after ``gpu_check.py``, with the variable set, and this
adds its section ``sanitizer`` to the report that ``gpu_check.py`` wrote (gpu_check.json,
.md, .txt): the sanitizer raises ``CUDASanitizerErrors`` (an unsynchronized access of a
tensor by two streams: a gathered buffer freed or reused before the collective that reads it
finished, a host copy racing a device copy) at the kernel launch that races, which fails the
case with its text.

The cases, at world 1 with the size-one groups kept (real NCCL collectives on flatshard's
streams; ``gpu_check_forced``): ``hybrid_shard`` over a (1, 1) (replicate, shard) mesh, both
groups kept; ``cpu_offload`` (parameters offloaded, pinned). Each: three AdamW steps, the loss
finite and the collectives issued. Without CUDA (the dry run) the cases still run on the CPU
(Gloo) so they cannot rot, and ``sanitizer_on`` is skipped with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import time

import torch
from gpu_check_common import LINES, Ctx, lm_loss, run_checks, say, setup, status_of
from gpu_check_forced import Spy, forced_groups
from gpu_check_report import markdown

import flatshard as fs
import flatshard.api as fs_api
import flatshard.core.mesh as fs_mesh
from flatshard.comm.shutdown import end_process_group


@contextlib.contextmanager
def both_groups_kept():
    """hybrid_shard at world 1: both size-one groups put back (the mesh's whole group serves
    as each), so the reduce-scatter and the replicate all-reduce are issued."""
    original = fs_mesh.resolve_topology

    def resolve(strategy, mesh):
        topo = original(strategy, mesh)
        group = topo.mesh_group
        hosts = (fs_mesh._host_group(group, topo.made),) * 2
        return dataclasses.replace(topo, shard_group=group, replicate_group=group,
                                   shard_rank=0, shard_world=1, host_groups=hosts)  # fmt: skip

    fs_mesh.resolve_topology = fs_api.resolve_topology = resolve
    try:
        yield
    finally:
        fs_mesh.resolve_topology = fs_api.resolve_topology = original


def _train(c: Ctx, model) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    with Spy() as spy:
        for x in (c.x, c.x2, c.x):
            loss = lm_loss(model, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        if c.cuda:
            torch.cuda.synchronize()  # a race on the last step's copies is reported here
    issued = sum(spy.calls.values())
    ok = all(math.isfinite(v) for v in losses) and issued > 0
    return {"ok": ok, "losses": losses, "issued": issued, "calls": dict(spy.calls)}


def check_sanitizer_on(c: Ctx) -> dict:
    if not c.cuda:
        return {"skipped": "CUDA only: the sanitizer watches CUDA streams"}
    from torch.cuda import _sanitizer

    return {"ok": bool(_sanitizer.cuda_sanitizer.enabled)}


def check_hybrid_shard(c: Ctx) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(c.device.type, (1, 1), mesh_dim_names=("replicate", "shard"))
    with both_groups_kept():
        model = c.sharded(strategy="hybrid_shard", mesh=mesh)
    return _train(c, model)


def check_cpu_offload(c: Ctx) -> dict:
    with forced_groups():
        model = c.sharded(offload=fs.CPUOffload(params=True))
    out = _train(c, model)
    pinned = all(p.is_pinned() for p in model.parameters()) if c.cuda else None
    out.update(pinned=pinned, ok=out["ok"] and pinned is not False)
    return out


CHECKS = [check_sanitizer_on, check_hybrid_shard, check_cpu_offload]


def add_to_report(out_dir: str, section: dict) -> dict:
    """Add ``section`` as ``sanitizer`` to gpu_check.py's report and rewrite its files."""
    path = os.path.join(out_dir, "gpu_check.json")
    with open(path) as f:
        report = json.load(f)
    report["sections"]["sanitizer"] = section
    report["ok"] = bool(report.get("ok")) and section["status"] != "fail"
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(out_dir, "gpu_check.md"), "w") as f:
        f.write(markdown(report))
    with open(os.path.join(out_dir, "gpu_check.txt"), "a") as f:
        f.write("\n".join(LINES) + "\n")
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None, help="GPT preset (default: small, tiny on the CPU)")
    args = p.parse_args()
    device = setup()
    cuda = device.type == "cuda"
    preset = args.model or ("small" if cuda else "tiny")
    c = Ctx(device, preset, batch=2, seq=128 if cuda else 16)
    enabled = os.environ.get("TORCH_CUDA_SANITIZER")  # set by gpu_check.sh with CUDA only
    say(f"\n== sanitizer (TORCH_CUDA_SANITIZER={enabled if enabled is not None else 'unset'}, "
        f"GPT {preset})")  # fmt: skip
    t0 = time.perf_counter()
    results = run_checks(CHECKS, c)
    section = {"status": status_of(results), "seconds": time.perf_counter() - t0}
    section["checks"] = results
    say(f"-- sanitizer: {section['status'].upper()} in {section['seconds']:.1f}s")
    report = add_to_report(args.out, section)
    end_process_group()
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
