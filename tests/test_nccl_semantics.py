"""flatshard under NCCL's rules, on the CPU: the ``strict_async`` backend and what runs on it.

(a) The backend itself (``flatshard.testing.nccl_semantics``): each rule fires on a deliberate
    misuse, and a flatshard that skipped a gather's wait would fail parity under it.
(b) A slice of the parity suite (every strategy, bf16, fp16 + GradScaler, offload with
    ``fs.clip_grad_norm_`` and optimizer-state save/load, hybrid, activation checkpointing,
    ``no_sync``, prefetch, coalescing, Muon/Adafactor, checkpoints) at world 2, 3 and 4:
    parity as on Gloo, zero violations, zero timed waits, no collective left unwaited.
(c) Under ``fs.CPUOffload`` every tensor handed to a collective is on the compute device,
    checked with ``flatshard.testing.virtual_device`` (a virtual compute device on the CPU).

One job per world runs every case of that world (``nccl_pool.run_cases``); the tests read it.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from flatshard.testing import nccl_semantics as ns
from flatshard.testing.virtual_device import COMPUTE, VirtualDevice
from nccl_pool import run_cases, strict_pools  # noqa: F401 (the fixture)
from nccl_slice import SLICE

TIMEOUT = datetime.timedelta(seconds=60)


# ---- (a) the backend: every rule must be able to fail ------------------------------------------
def _scenario(fn) -> dict:
    ns.reset()
    observed = fn()
    report = ns.report()
    return {**observed, "violations": report["violations"], "timed": report["timed_waits"]}


def _read_before_wait() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = torch.zeros(world, 3)
    out[rank] = rank + 1.0
    work = dist.all_gather_single(out.view(-1), out[rank], async_op=True)  # in place
    early = out.clone()
    work.wait()
    ints = torch.full((2,), rank + 1, dtype=torch.int32)
    work = dist.all_reduce(ints, async_op=True)
    early_ints = ints.clone()
    work.wait()
    others = torch.cat([early[:rank], early[rank + 1 :]])
    return {
        "others_nan": bool(others.isnan().all()),
        "own_kept": early[rank].tolist() == [rank + 1.0] * 3,
        "after": out[:, 0].tolist(),
        "ints": (early_ints.tolist(), ints.tolist()),
    }


def _mutated_input() -> dict:
    out, full = torch.empty(2), torch.arange(2.0 * dist.get_world_size())
    work = dist.reduce_scatter_single(out, full, async_op=True)
    full.add_(100)  # NCCL may read either value
    work.wait()
    return {}


def _written_output() -> dict:
    tensor = torch.ones(3)
    work = dist.all_reduce(tensor, async_op=True)
    tensor.zero_()  # NCCL writes it concurrently
    work.wait()
    return {}


def _resized_in_flight() -> dict:
    out, shard = torch.empty(2 * dist.get_world_size()), torch.ones(2)
    work = dist.all_gather_single(out, shard, async_op=True)
    storage, nbytes = out.untyped_storage(), out.untyped_storage().nbytes()
    storage.resize_(0)  # flatshard's way of freeing a gather buffer
    storage.resize_(nbytes)
    work.wait()
    ns.configure(raise_on_violation=True)  # the default: refused at the call, loudly
    work = dist.all_gather_single(out, shard, async_op=True)
    try:
        out.untyped_storage().resize_(0)
        raised = ""
    except ns.NcclSemanticsViolation as err:
        raised = str(err)
    finally:
        ns.configure(raise_on_violation=False)
    work.wait()
    return {"raised": raised, "kept": out.untyped_storage().nbytes() == nbytes}


def _waits() -> dict:
    from flatshard.comm.collectives import PendingWork

    dist.all_reduce(torch.ones(1), async_op=True).wait(TIMEOUT)  # what NCCL must not get
    dist.all_reduce(torch.ones(1), async_op=True).wait()
    PendingWork(dist.all_reduce(torch.ones(1), async_op=True), "all_reduce").wait(TIMEOUT)
    left = dist.all_reduce(torch.ones(1), async_op=True)
    never = ns.report()["never_waited"]
    left.wait()
    return {"never": never}


def _host_tensors() -> dict:
    device = VirtualDevice()
    ns.add_tensor_check(device.host_collective_check)
    try:
        with device:
            dist.all_reduce(torch.ones(2))  # a host tensor: NCCL has no CPU backend
            dist.all_reduce(torch.ones(2, device=COMPUTE))
            dist.all_reduce(torch.ones(2).to(COMPUTE))
            on_device = torch.ones(2, device=COMPUTE)
            _ = on_device + torch.tensor(2.0)  # a 0-dim host scalar: CUDA accepts it
            _ = on_device + torch.ones(2)  # CUDA refuses: "Expected all tensors to be on the same"
    finally:
        ns.remove_tensor_check(device.host_collective_check)
    return {"mixed": device.mixed}


SCENARIOS = [_read_before_wait, _mutated_input, _written_output, _resized_in_flight, _waits]


def case_semantics() -> dict:
    return {fn.__name__[1:]: _scenario(fn) for fn in [*SCENARIOS, _host_tensors]}


@pytest.fixture(scope="module")
def semantics(strict_pools):  # noqa: F811
    job = [("semantics", "test_nccl_semantics", "case_semantics", ())]
    return [r["semantics"] for r in strict_pools(2).run(run_cases, job)]


def _only(results: list[dict], key: str, *needles: str) -> None:
    for rank, r in enumerate(results):
        assert r["error"] is None, r["error"]
        violations = r["result"][key]["violations"]
        assert len(violations) >= 1, f"rank {rank}: {key} went unnoticed"
        for v in violations:
            assert all(n in v for n in needles), (needles, v)


@pytest.mark.harness
def test_outputs_hold_garbage_until_wait(semantics):
    for r in semantics:
        got = r["result"]["read_before_wait"]
        assert got["others_nan"] and got["own_kept"], got  # in place: our chunk is the input
        assert got["after"] == [1.0, 2.0] and got["violations"] == []
        assert got["ints"] == ([torch.iinfo(torch.int32).min] * 2, [3, 3])


@pytest.mark.harness
def test_an_input_changed_in_flight_is_a_violation(semantics):
    _only(semantics, "mutated_input", "reduce_scatter", "input was modified", "test_nccl_")


@pytest.mark.harness
def test_an_output_written_in_flight_is_a_violation(semantics):
    _only(semantics, "written_output", "all_reduce", "output was written")


@pytest.mark.harness
def test_a_buffer_resized_in_flight_is_refused(semantics):
    _only(semantics, "resized_in_flight", "all_gather")
    for r in semantics:
        got = r["result"]["resized_in_flight"]
        assert "resized to 0 bytes" in got["raised"] and got["kept"], got
        assert any("resized to 0 bytes" in v for v in got["violations"])


@pytest.mark.harness
def test_timed_waits_are_counted_and_flatshard_makes_none(semantics):
    for r in semantics:
        got = r["result"]["waits"]
        assert got["timed"] == 1, got  # the raw wait(timeout) only, not PendingWork's
        assert got["never"] and got["never"][0].startswith("all_reduce issued at"), got


@pytest.mark.harness
def test_a_host_tensor_reaching_a_collective_is_a_violation(semantics):
    _only(semantics, "host_tensors", "a host tensor ((2,), torch.float32) was handed to")
    for r in semantics:
        got = r["result"]["host_tensors"]
        assert len(got["violations"]) == 1 and len(got["mixed"]) == 1, got
        assert "add" in got["mixed"][0], got


def test_pending_work_passes_a_timeout_only_on_gloo(patched_attr):
    from flatshard.comm import collectives

    class Work:
        def wait(self, *timeout) -> bool:
            seen.append(timeout)
            return True

    for backend, expected in (("gloo", (TIMEOUT,)), ("nccl", ()), ("strict_async", ())):
        seen: list = []
        with patched_attr(collectives.dist, "get_backend", lambda *_, b=backend: b):
            collectives.PendingWork(Work(), "all_gather").wait(TIMEOUT)
        assert seen == [expected], (backend, seen)


def test_a_missed_gather_wait_in_flatshard_fails_parity(strict_pools):  # noqa: F811
    job = [("mutant", "nccl_slice", "case_flatshard_skips_a_gather_wait", ())]
    for rank, r in enumerate(strict_pools(2).run(run_cases, job)):
        got = r["mutant"]
        assert got["error"] is None, got["error"]
        assert not got["result"]["loss_err"] <= 1e-5, f"rank {rank}: NaN did not show"
        assert got["report"]["violations"], "freeing the unwaited buffers went unnoticed"


# ---- (b) the parity slice and (c) the offload device contract ---------------------------------
@pytest.fixture(scope="module")
def slice_results(strict_pools, tmp_path_factory):  # noqa: F811
    path = str(tmp_path_factory.mktemp("strict_ckpt") / "step3")
    done: dict[int, list[dict]] = {}

    def get(world: int) -> list[dict]:
        if world == 3:
            get(2)  # its checkpoint is resumed at world 3
        if world not in done:
            job = [s.job(path) for s in SLICE if s.world == world]
            done[world] = strict_pools(world).run(run_cases, job)
        return done[world]

    return get


@pytest.mark.parametrize("spec", [s.param() for s in SLICE])
def test_under_nccl_semantics(slice_results, spec):
    per_rank = [r[spec.label] for r in slice_results(spec.world)]
    for rank, r in enumerate(per_rank):
        assert r["error"] is None, f"rank {rank}:\n{r['error']}"
        report = r["report"]
        assert report["violations"] == [], f"rank {rank}: " + "\n".join(report["violations"])
        assert report["timed_waits"] == 0, report["timed_wait_sites"]
        assert report["never_waited"] == [], report["never_waited"]
    spec.checked([r["result"] for r in per_rank])
