"""A pool of long-lived Gloo worker processes that run many test cases per spawn.

``DistPool(world).run(fn, *args)`` runs the module-level function ``fn(*args)`` on every rank
of an initialised ``world``-rank Gloo group and returns the per-rank results (rank order). An
exception on any rank fails the call with that rank's traceback; a case that does not finish in
time fails too, and the pool is rebuilt (its collectives may be out of step after a failure).
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import traceback

import torch.multiprocessing as mp

CASE_TIMEOUT_S = float(os.environ.get("FLATSHARD_TEST_CASE_TIMEOUT_S", 240))
ERROR_GRACE_S = 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, world: int, port: int, path: list[str], jobs, results, backend="gloo", setup=None
) -> None:
    os.environ.update(
        OMP_NUM_THREADS="1",
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    sys.path[:0] = [p for p in path if p not in sys.path]
    import datetime
    import importlib

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if setup is not None:  # a module whose import registers ``backend`` (a test backend)
        importlib.import_module(setup)
    dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=CASE_TIMEOUT_S)
    )
    while (job := jobs.get()) is not None:
        module_name, fn_name, args = job
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
            results.put((rank, True, fn(*args)))
        except BaseException:  # report everything, the pool decides
            results.put((rank, False, traceback.format_exc()))
    from flatshard.comm.shutdown import end_process_group

    end_process_group()


class DistPool:
    def __init__(self, world: int, backend: str = "gloo", setup: str | None = None) -> None:
        self.world = world
        self.backend, self.setup = backend, setup  # setup: imported first, registers backend
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._jobs = [ctx.Queue() for _ in range(self.world)]
        self._results = ctx.Queue()
        port = _free_port()
        self._procs = [
            ctx.Process(
                target=_worker,
                daemon=True,
                args=(r, self.world, port, list(sys.path), self._jobs[r], self._results),
                kwargs={"backend": self.backend, "setup": self.setup},
            )
            for r in range(self.world)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, timeout: float = CASE_TIMEOUT_S) -> list:
        job = (fn.__module__, fn.__name__, args)
        for q in self._jobs:
            q.put(job)
        results: dict[int, object] = {}
        errors: list[str] = []
        try:
            for _ in range(self.world):
                # After a failure the other ranks are usually stuck in a collective: give them
                # a few seconds to report their own error, then stop waiting.
                wait = ERROR_GRACE_S if errors else timeout
                rank, ok, value = self._results.get(timeout=wait)
                if ok:
                    results[rank] = value
                else:
                    errors.append(f"--- rank {rank} ---\n{value}")
        except queue.Empty:
            if errors:
                self._restart()
                raise AssertionError(f"{fn.__name__} failed:\n" + "\n".join(errors)) from None
            self._restart()
            raise TimeoutError(
                f"{fn.__name__} did not finish on every rank in {timeout}s"
            ) from None
        if errors:
            self._restart()
            raise AssertionError(f"{fn.__name__} failed:\n" + "\n".join(errors))
        return [results[r] for r in range(self.world)]

    def _restart(self) -> None:
        self.close(graceful=False)
        self._start()

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for q in self._jobs:
                q.put(None)
            for p in self._procs:
                p.join(timeout=20)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join()
