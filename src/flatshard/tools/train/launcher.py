"""Starting the workers: torch's elastic launcher locally, or nothing under torchrun/srun.

Every worker sees torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) whatever started it:

* **torchrun** (or any launcher that sets ``RANK`` and ``WORLD_SIZE``): this process *is* a worker.
* **SLURM** ``srun`` (one task per GPU): this process is a worker too; the ``SLURM_*`` variables
  are mapped to torchrun's names (:func:`slurm_environment`).
* **Otherwise**: :func:`launch_local` starts ``nproc`` workers on this machine with
  ``torch.distributed.launcher.api.elastic_launch`` -- the engine inside ``torchrun`` -- using a
  c10d rendezvous on a free localhost port (torchrun's ``--standalone``).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import uuid
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "LOCAL_LAUNCH_ENV",
    "failure_report",
    "first_host",
    "launch_local",
    "launched_externally",
    "slurm_environment",
]

_DEFAULT_PORT = 29500
LOCAL_LAUNCH_ENV = "FLATSHARD_LOCAL_LAUNCH"
"""Set for workers started by :func:`launch_local`: they write errors to torch elastic's error
file only, and :func:`failure_report` prints them once (not once per rank)."""


def launched_externally(env: Mapping[str, str]) -> str | None:
    """``"torchrun"``, ``"srun"`` or None (nobody started us as a worker: launch locally).

    A SLURM batch script itself also has ``SLURM_PROCID``; only a job *step* started by ``srun``
    has ``SLURM_STEP_ID``, so a plain ``flatshard train`` inside ``sbatch`` still launches locally.
    """
    if "RANK" in env and "WORLD_SIZE" in env:
        return "torchrun"
    if "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        return "srun"
    return None


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"gpu[03-05,9],cpu1"`` -> ``"gpu03"``."""
    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", nodelist.strip())
    if not match or not match.group(0):
        raise ValueError(f"cannot read a host name from SLURM node list {nodelist!r}")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    return prefix + re.split(r"[-,]", ranges)[0]


def slurm_environment(env: Mapping[str, str]) -> dict[str, str]:
    """torchrun's variables derived from an ``srun`` task's ``SLURM_*`` variables.

    ``MASTER_ADDR`` is the first node of the step (every task computes the same one);
    ``MASTER_PORT`` defaults to a port derived from the job id so concurrent jobs on a shared
    node do not collide. Values the user already exported win.
    """
    world = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS", "1")
    nodes = (
        env.get("SLURM_STEP_NODELIST")
        or env.get("SLURM_JOB_NODELIST")
        or env.get("SLURM_NODELIST", "")
    )
    addr = first_host(nodes) if nodes else env.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")
    port = _DEFAULT_PORT + int(env.get("SLURM_JOB_ID", "0")) % 20000
    per_node = re.match(r"\d+", env.get("SLURM_STEP_TASKS_PER_NODE", "") or "")
    derived = {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": world,
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "GROUP_RANK": env.get("SLURM_NODEID", "0"),
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
    }
    if per_node:
        derived["LOCAL_WORLD_SIZE"] = per_node.group(0)
    return {k: env.get(k, v) for k, v in derived.items()}


def launch_local(
    nproc: int, entrypoint: Callable[..., Any], *args: Any, cpu: bool, max_restarts: int = 0
) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` in ``nproc`` fresh worker processes; their return values by rank.

    Raises ``torch.distributed.elastic.multiprocessing.errors.ChildFailedError`` if any worker
    fails (the agent notices a dead worker within ``monitor_interval`` and stops the others) and
    no restart is left; with ``max_restarts`` the whole group is restarted that many times (each
    worker sees ``TORCHELASTIC_RESTART_COUNT``). On CPU each worker gets ``OMP_NUM_THREADS=1``
    unless the user set it: ``nproc`` processes each using every core would oversubscribe it.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if cpu and not os.environ.get("OMP_NUM_THREADS"):
        os.environ["OMP_NUM_THREADS"] = "1"
    os.environ[LOCAL_LAUNCH_ENV] = "1"  # workers leave error reports to this process
    # torch >= 2.5 shares the agent's rendezvous TCPStore with the workers and keeps it across
    # restarts: restarted workers may read the dead ones' Gloo/NCCL addresses and hang in
    # init_process_group (pytorch/pytorch#135712). Unshared, rank 0 hosts a fresh store each time.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if "LOGLEVEL" not in os.environ:  # torch's own switch for its launcher logs
        _quiet_launcher_logs()
        if max_restarts:
            _announce_restarts()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port, as torchrun --standalone
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
    )
    sys.stdout.flush()
    return elastic_launch(config, entrypoint)(*args)


def _quiet_launcher_logs() -> None:
    """The elastic agent logs every worker failure as a long traceback of its own polling code,
    and every teardown as warnings; :func:`failure_report` says what matters, once."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


class _RestartNotes(logging.Handler):
    """One line on stderr when the (silenced) agent restarts the workers: which rank failed and
    how, read from the agent's own log records (their wording is torch's, hence the fallbacks)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.failure = "a worker failed"

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if failed := re.search(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)", text):
            code, rank = int(failed.group(1)), failed.group(2)
            self.failure = f"rank {rank} {_how(code)}"
        elif left := re.search(r"(\d+)/(\d+) attempts left", text):
            remaining, total = int(left.group(1)), int(left.group(2))
            print(
                f"flatshard train: {self.failure}; restarting the workers (restart "
                f"{total - remaining + 1} of {total}), resuming from the newest checkpoint",
                file=sys.stderr,
                flush=True,
            )
            self.failure = "a worker failed"


def _how(exitcode: int) -> str:
    """``-9`` -> ``"was killed by SIGKILL"``; ``1`` -> ``"exited with status 1"``."""
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


def _announce_restarts() -> None:
    handler = _RestartNotes()
    for name in ("multiprocessing.api", "agent.server.api"):
        logger = logging.getLogger(f"torch.distributed.elastic.{name}")
        logger.setLevel(logging.INFO)
        logger.propagate = False
        logger.handlers = [handler]


def failure_report(failures: Mapping[int, Any]) -> tuple[str, int]:
    """The text and exit status for ``ChildFailedError.failures`` (rank -> ProcessFailure).

    Workers stopped by the agent because another one failed (SIGTERM) are not the cause; each
    distinct error message is shown once with the ranks that raised it.
    """
    causes = {r: f for r, f in failures.items() if f.exitcode > 0} or dict(failures)
    by_message: dict[str, list[int]] = {}
    for rank, f in sorted(causes.items()):
        data = f.error_file_data.get("message") if isinstance(f.error_file_data, dict) else None
        if isinstance(data, dict):  # written by the worker: "Type: message" (+ traceback)
            text = data.get("message", "")
            if f.exitcode != 2:  # not a user error: the traceback helps
                text = data.get("extraInfo", {}).get("py_callstack", text).rstrip()
        elif f.exitcode < 0:
            text = f"killed by {f.signal_name()}" + (
                " (out of memory?)" if f.exitcode == -9 else ""
            )
        else:
            text = f"exited with status {f.exitcode} without an error report"
        by_message.setdefault(text, []).append(rank)
    lines = [
        f"flatshard train: rank {', '.join(map(str, ranks))}: {text}"
        for text, ranks in by_message.items()
    ]
    status = 2 if all(f.exitcode == 2 for f in causes.values()) else 1
    return "\n".join(lines), status
