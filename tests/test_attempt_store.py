"""Restarted workers on torchrun's shared agent store (issue 37; see [Note: stale keys after a
torchrun restart] in flatshard/comm/attempt_store.py).

This process plays the rank-0 agent: it hosts one multi-tenant TCPStore that outlives every
"attempt", as torchrun's does. Each attempt starts two fresh Gloo workers on it; the second
attempt starts rank 1 late, so rank 0 meets the first attempt's rank-1 address in the store.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch.distributed as dist

from flatshard.comm import attempt_store as a

WORKER = textwrap.dedent(
    """
    import datetime, os, sys, time
    import torch, torch.distributed as dist
    from flatshard.comm.attempt_store import attempt_store
    from flatshard.comm.shutdown import end_process_group

    time.sleep(float(os.environ["DELAY_S"]))
    timeout = datetime.timedelta(seconds=8)
    extra = attempt_store(timeout) if os.environ["FIX"] == "1" else {}
    dist.init_process_group("gloo", timeout=timeout, **extra)
    sub = dist.new_group([0, 1])  # a side group's keys are stale too without the prefix
    x = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(x, group=sub)
    print("sum", int(x.item()), flush=True)
    end_process_group()
    """
)


def _attempt(port: int, delays: tuple[float, float], fix: bool) -> list[tuple[int, str]]:
    """Both workers of one attempt; their (status, output). Killed after 60 s: no orphans."""
    procs = []
    try:
        for rank, delay in enumerate(delays):
            env = dict(
                os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                WORLD_SIZE="2", LOCAL_RANK=str(rank), TORCHELASTIC_USE_AGENT_STORE="True",
                DELAY_S=str(delay), FIX="1" if fix else "0", OMP_NUM_THREADS="1",
            )  # fmt: skip
            cmd = [sys.executable, "-c", WORKER]
            out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True, **out))
        return [(p.wait(timeout=60), p.stdout.read()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)


def _agent_store() -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, multi_tenant=True,
        timeout=datetime.timedelta(seconds=30),
    )  # fmt: skip


def test_a_restarted_attempt_ignores_the_dead_attempts_addresses():
    store = _agent_store()
    first = _attempt(store.port, (0.0, 0.0), fix=True)
    assert [code for code, _ in first] == [0, 0], first
    # rank 1 late: rank 0 finds its old address; rank 0 late: rank 1 finds the old attempt id
    for delays in ((0.0, 2.0), (2.0, 0.0)):
        again = _attempt(store.port, delays, fix=True)
        assert [code for code, _ in again] == [0, 0], (delays, again)
        assert all("sum 3" in out for _, out in again), (delays, again)


def test_a_missing_rank_is_a_timeout_that_names_it():
    store = _agent_store()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not join attempt"):
        a._lead(store, 2, time.monotonic() + 0.3)  # rank 1 never answers
    store.set(a.ID_KEY, "dead")  # an id whose rank 0 is gone: never echoed
    with pytest.raises(TimeoutError, match=r"rank 3\].*rank 0 did not start.*last id read: dead"):
        a._follow(store, 3, time.monotonic() + 0.3)
