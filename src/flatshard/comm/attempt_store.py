"""A store of this attempt's own for workers that torchrun restarts (``--max-restarts``).

[Note: stale keys after a torchrun restart]
Since torch 2.5 torchrun's rendezvous shares the agent's TCPStore with the workers
(``TORCHELASTIC_USE_AGENT_STORE=True``; opt out with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
in the *agent's* environment). The rank-0 agent creates that store once and keeps it across
restarts, and torch adds no per-attempt prefix, so a restarted worker's
``init_process_group`` finds the previous attempt's keys under the same names: the dead
workers' Gloo addresses. Whether a rank reads its peer's stale address or the fresh one is a
race between the peer's ``set`` and its own ``get``; a rank that loses it connects to a port
nobody listens on ("connectFullMesh ... Connection refused", or a hang until the timeout).
Measured on the 2-core box, two agents x 1 worker, one worker SIGKILLed at a random step
(``bench/multinode.py``): 3 of 3 restarts failed so; a plain torch script that starts faster
wins the race more often (pytorch#135712 reports the same). A prefix from
``TORCHELASTIC_RESTART_COUNT`` does not help: an agent whose own workers were healthy restarts
them for the "membership change" without counting it, so the nodes disagree (seen: 1 and 0).

So the ranks agree on a fresh prefix through the shared store itself, in a way a stale key
cannot fake: rank 0 publishes a random attempt id; every other rank answers under that id with
a random token of its own and waits for rank 0 to echo it. An id left by a dead attempt is never
echoed (its rank 0 is gone: torchrun stops every worker before the next rendezvous), so such a
rank re-reads the id until it sees the live one. The process group then uses the store under
``flatshard/attempt/<id>/``, where nothing old can be.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import uuid
from typing import Any

import torch.distributed as dist

__all__ = ["attempt_store", "shares_agent_store"]

ID_KEY = "flatshard/attempt"
ECHO_WAIT_S = 1.0  # how long a rank waits for rank 0's echo before re-reading the id
POLL_S = 0.05  # one store request per rank per poll


def shares_agent_store() -> bool:
    """True for a worker that torchrun points at its agent's long-lived store (see the Note)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def attempt_store(timeout: datetime.timedelta) -> dict[str, Any]:
    """``init_process_group`` arguments (``store``, ``rank``, ``world_size``) that keep this
    attempt's keys apart from a previous attempt's; ``{}`` (torch's own ``env://``) unless the
    store is torchrun's shared one. Raises ``TimeoutError`` after ``timeout`` without every rank.
    """
    if not shares_agent_store():
        return {}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    deadline = time.monotonic() + timeout.total_seconds()
    attempt = _lead(store, world, deadline) if rank == 0 else _follow(store, rank, deadline)
    if os.environ.get("FLATSHARD_ATTEMPT_LOG") == "1":  # for bench/multinode.py's logs
        print(f"[flatshard rank {rank}] attempt {attempt}", file=sys.stderr, flush=True)
    prefixed = dist.PrefixStore(f"flatshard/attempt/{attempt}", store)
    return {"store": prefixed, "rank": rank, "world_size": world}


def _lead(store: dist.Store, world: int, deadline: float) -> str:
    """Rank 0: publish a fresh id, echo every other rank's token under it."""
    attempt = uuid.uuid4().hex
    store.set(ID_KEY, attempt)
    keys = [f"{ID_KEY}/{attempt}/hello/{r}" for r in range(1, world)]
    # polled, not store.wait(timeout): a timed-out wait leaves the client's socket expecting a
    # reply that arrives later, as the answer to the next request
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [r for r, key in enumerate(keys, 1) if not store.check([key])]
            raise TimeoutError(
                f"[flatshard rank 0] ranks {missing} did not join attempt {attempt} within "
                "parallel.timeout_s; their node may be down or still starting"
            )
        time.sleep(POLL_S)
    for key in keys:
        store.set(f"{ID_KEY}/{attempt}/echo/{store.get(key).decode()}", "1")
    return attempt


def _follow(store: dist.Store, rank: int, deadline: float) -> str:
    """Any other rank: answer the published id until rank 0 echoes this process's token."""
    token, attempt = uuid.uuid4().hex, None
    while time.monotonic() < deadline:
        if not store.check([ID_KEY]):
            time.sleep(POLL_S)
            continue
        attempt = store.get(ID_KEY).decode()
        store.set(f"{ID_KEY}/{attempt}/hello/{rank}", token)
        answer_by = min(time.monotonic() + ECHO_WAIT_S, deadline)
        while time.monotonic() < answer_by:
            if store.check([f"{ID_KEY}/{attempt}/echo/{token}"]):
                return attempt
            time.sleep(POLL_S)
        # no echo: a dead attempt's id (or rank 0 is still waiting for others): read it again
    raise TimeoutError(
        f"[flatshard rank {rank}] rank 0 did not start this attempt within parallel.timeout_s "
        f"(last id read: {attempt}); its node may be down or still starting"
    )
