"""``strict_pools(world)``: worker pools whose process group is ``strict_async``, Gloo with NCCL's
semantics (``flatshard.testing.nccl_semantics``). Import the fixture into a test module:
``from nccl_pool import strict_pools``. One pool per world size per module (closed after it:
idle workers hold a few hundred MB each on the CI box)."""

from __future__ import annotations

import pytest

from dist_pool import DistPool

BACKEND = "strict_async"
SETUP = "flatshard.testing.strict_async"  # imported by each worker first: registers BACKEND


@pytest.fixture(scope="module")
def strict_pools():
    pools: dict[int, DistPool] = {}

    def get(world: int) -> DistPool:
        if world not in pools:
            pools[world] = DistPool(world, backend=BACKEND, setup=SETUP)
        return pools[world]

    yield get
    for pool in pools.values():
        pool.close(graceful=False)  # as dist_pools: nothing of the workers is needed


def run_cases(cases: list[tuple[str, str, str, tuple]]) -> dict[str, dict]:
    """On every rank of a strict pool: run each ``(label, module, function, args)`` in turn
    and return per label its ``result`` (or ``error``, a traceback) and this rank's
    ``nccl_semantics.report()`` for that case alone. Violations are recorded, not raised, so
    that the ranks stay in step and every case reports (one job runs many cases)."""
    import importlib
    import traceback

    from flatshard.testing import nccl_semantics

    nccl_semantics.configure(raise_on_violation=False)
    out: dict[str, dict] = {}
    for label, module, name, args in cases:
        nccl_semantics.reset()
        result, error = None, None
        try:
            result = getattr(importlib.import_module(module), name)(*args)
        except Exception:  # the case fails; the next ones still run
            error = traceback.format_exc()
        out[label] = {"result": result, "error": error, "report": nccl_semantics.report()}
    nccl_semantics.configure(raise_on_violation=True)
    return out
