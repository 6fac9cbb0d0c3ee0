"""Virtual CUDA streams on the CPU (``flatshard.testing.virtual_streams``, ``stream_access``).

(a) The backend itself: each hand-written misuse is caught (a missing ``wait_stream``, a
    wait on the wrong stream followed by a free, an output read before its wait, a gather
    buffer reused while a reduce still reads it, a buffer freed by ``resize_`` in flight), a
    correct program shows none, and flatshard mutants are caught (``on_side_stream`` without
    its ``wait_stream``; ``then_issue`` as it was before the hybrid fix).
(b) torch's FSDP2 (``fully_shard`` on a CPU mesh: its ``torch.cpu`` stream stubs become
    virtual streams) runs clean, exact against one process, issuing from its side streams.
(c) flatshard's device path under it: the ``tests/nccl_slice.py`` cases of
    ``stream_cases.SLICE_LABELS`` (every strategy, hybrid at world 4 on a 2x2 mesh, bf16, fp16,
    offload, prefetch, activation checkpointing, ``no_sync``, coalescing, Muon, Adafactor),
    prefetch depths, and (slow) pipeline 1F1B / ZBVZeroBubble / InterleavedZeroBubble and
    experts on their own mesh: each exact (its own test's check) with zero violations.

Tensor parallelism runs under it (FSDP x TP at dp2 x tp2, with and without sequence and loss
parallelism): DTensor's functional collectives are carried by
``flatshard.testing.functional_collectives``, and a functional result read before its wait is
caught like any other. Compiled blocks run under it too (``aot_eager``, fullgraph: the
access mode says ``ignore_compile_internals``, so Dynamo compiles under it and the graph's
aten ops are recorded at run time; a compiled read before a wait is caught). What it cannot
see: the inside of an inductor kernel.
"""

from __future__ import annotations

import pytest

import stream_cases
from nccl_pool import strict_pools  # noqa: F401 (the fixture)
from nccl_slice import SLICE
from stream_cases import EXTRA, MISUSES, SLICE_LABELS, run_stream_cases
from stream_cases import assert_clean as _clean

_SLICE = {(s.world, s.label): s for s in SLICE}


def _job(label: str, function: str, *args) -> tuple:
    return (label, "stream_cases", function, args)


@pytest.fixture(scope="module")
def backend(strict_pools):  # noqa: F811
    jobs = [_job(label, fn) for label, (fn, _, _) in MISUSES.items()]
    jobs += [_job("correct", "correct_program"), _job("no wait_stream", "mutant_no_wait_stream")]
    jobs += [_job("old then_issue", "mutant_drops_first_buffers")]
    return strict_pools(4).run(run_stream_cases, jobs)


# ---- (a) the backend ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(MISUSES))
def test_a_misuse_is_caught(backend, name):
    _, kind, op = MISUSES[name]
    for rank, per_label in enumerate(backend):
        r = per_label[name]
        assert r["error"] is None, r["error"]
        hits = [v for v in r["streams"] if v.startswith(f"{kind}:") and op in v]
        assert hits, f"rank {rank}: {name} went unnoticed: {r['streams']}"
        assert all("stream_cases.py:" in v and "buffer #" in v for v in hits), hits


def test_the_streams_are_named(backend):
    """A violation names both streams, the op, the buffer and the lines."""
    free = backend[0]["wait on the wrong stream, then free"]["streams"][0]
    assert "reduce_scatter on reduce_scatter#" in free and "hands it to compute" in free, free
    assert "freed (its last reference dropped) at stream_cases.py:" in free, free
    read = backend[0]["read before wait"]["streams"][0]
    assert read.startswith("read: sum on compute at stream_cases.py:"), read
    assert "that all_reduce on all_reduce#1 wrote at" in read, read


def test_a_correct_program_shows_no_violation(backend):
    for rank, per_label in enumerate(backend):
        r = per_label["correct"]
        _clean(r, rank, "correct")
        world = len(backend)  # out = the sum over ranks of each one's 2 * gathered chunk
        assert r["result"]["total"] == 4 * 2.0 * world * sum(range(world)), r["result"]
        assert r["collectives"] == {"side": 4}, r["collectives"]


def test_flatshard_without_its_wait_stream_is_caught(backend):
    for rank, per_label in enumerate(backend):
        found = per_label["no wait_stream"]["streams"]
        assert any("flatshard/core/gather.py" in v for v in found), (rank, found)
        assert any("flatshard/core/reduce.py" in v for v in found), (rank, found)


def test_then_issue_before_the_fix_is_caught(backend):
    """The hybrid race: the flat gradient (``torch.cat`` in ``flat_grad_from``, on the
    compute stream) dropped once the reduce side stream waited for the reduce-scatter."""
    for rank, per_label in enumerate(backend):
        found = [v for v in per_label["old then_issue"]["streams"] if v.startswith("free:")]
        assert found, f"rank {rank}: the hybrid race went unnoticed"
        assert all("reduce_scatter on reduce_scatter#" in v for v in found), found
        assert any("allocated on compute by cat at flatshard/core/reduce.py" in v for v in found)


def test_streams_are_picked_per_model_from_the_group():
    import torch

    from flatshard.core.streams import CUDA, NO_STREAMS, streams_for
    from flatshard.testing import virtual_streams

    class Plain:
        pass

    class Offering:
        def flatshard_streams(self):
            return virtual_streams.API

    cpu = torch.device("cpu")
    assert streams_for(cpu, Plain()) is NO_STREAMS
    virtual = streams_for(cpu, Offering())
    assert virtual.api is virtual_streams.API and virtual.gather is not virtual.reduce
    assert isinstance(virtual.gather, virtual_streams.VStream)
    assert NO_STREAMS.side("gather") is None and NO_STREAMS.current() is None
    assert CUDA.record_stream is not None  # torch.cuda's API behind the same names


# ---- (b) FSDP2 and (c) flatshard's device path -----------------------------------------------
def _slice_labels(world: int, slow: bool) -> list[str]:
    return SLICE_LABELS.get(world, ([], []))[int(slow)]


def _spec_jobs(world: int, slow: bool) -> list[tuple]:
    jobs = [_job(label, "nan_loud_slice", world, label) for label in _slice_labels(world, slow)]
    return jobs + [_job(lb, fn, *args) for w, lb, fn, args, s in EXTRA if w == world and s == slow]


@pytest.fixture(scope="module")
def device_path(strict_pools, tmp_path_factory):  # noqa: F811
    done: dict[tuple, list[dict]] = {}

    def get(world: int, slow: bool) -> list[dict]:
        if (world, slow) not in done:
            jobs = _spec_jobs(world, slow)
            done[(world, slow)] = strict_pools(world).run(run_stream_cases, jobs, timeout=600)
        return done[(world, slow)]

    return get


def _params():
    for world in sorted({*SLICE_LABELS, *(e[0] for e in EXTRA)}):
        for slow in (False, True):
            for job in _spec_jobs(world, slow):
                marks = [pytest.mark.slow] if slow else []
                yield pytest.param(world, slow, job[0], id=f"{job[0]}-w{world}", marks=marks)


@pytest.mark.parametrize("world, slow, label", list(_params()))
def test_device_path_runs_clean(device_path, world, slow, label):
    per_rank = [r[label] for r in device_path(world, slow)]
    for rank, r in enumerate(per_rank):
        _clean(r, rank, label)
    results = [r["result"] for r in per_rank]
    if label in _slice_labels(world, slow):
        _SLICE[(world, label)].checked(results)
    else:
        CHECKS[label.split(" ")[0]](results, label)
    # the model really ran on virtual side streams (hybrid: the reduction's too)
    assert any(r["collectives"].get("side", 0) > 0 for r in per_rank), per_rank[0]["collectives"]


def _prefetch(results: list, label: str) -> None:
    assert all(r["err"] <= 1e-5 for r in results), (label, results)


def _fsdp2(results: list, label: str) -> None:
    assert all(max(r["loss_err"], r["sd_err"]) <= 1e-5 for r in results), (label, results)


def _pipeline(results: list, label: str) -> None:
    assert all("error" not in r for r in results), (label, results)
    assert max(r["err"] for r in results) <= 1e-6, (label, results)


def _experts(results: list, label: str) -> None:
    assert all(max(r["params"], r["norm"]) <= 1e-12 for r in results), (label, results)


def _tensor_parallel(results: list, label: str) -> None:
    rows = [row for per_rank in results for row in per_rank]
    assert all("error" not in r for r in rows), (label, rows)
    assert all(max(r["err"], r["norm_err"]) <= 1e-12 for r in rows), (label, rows)
    assert sum(r["holds"] for r in rows) == 2, rows  # the tp peers of rank 0 compared


def _compiled(results: list, label: str) -> None:
    from test_compile import EAGER_TOLERANCE

    for r in (case for per_rank in results for case in per_rank.values()):
        assert max(r["loss"], r["grad"], r["params"]) <= EAGER_TOLERANCE, (label, r)
        assert r["graphs"] == 1 and r["breaks"] == 0, (label, r)  # compiled, not eager


def _context_parallel(results: list, label: str) -> None:
    assert "params" in results[0], (label, results[0])  # rank 0 compared the full parameters
    for r in results:
        assert max(r[k] for k in ("own_tokens", "loss", "grad_norm", "params") if k in r) < 1e-10, (
            label,
            r,
        )


CHECKS = {"prefetch": _prefetch, "fsdp2": _fsdp2, "pipeline": _pipeline, "experts": _experts,
          "tp": _tensor_parallel, "compiled": _compiled, "cp": _context_parallel}  # fmt: skip


def test_the_lists_name_existing_cases():
    for world, (labels, slow_labels) in SLICE_LABELS.items():
        for label in labels + slow_labels:
            assert (world, label) in _SLICE, (world, label)
    for _, label, function, _, _ in EXTRA:
        assert callable(getattr(stream_cases, function)), label
        assert label.split(" ")[0] in CHECKS, label
