"""The collective watchdog (``flatshard.comm.watchdog``; [Note: the collective watchdog]) and
the collective log (``flatshard.comm.collective_log``; [Note: the collective log]).

Off Gloo, by default, a collective is only recorded in the log (no thread, no query of its
work); the polling watchdog is opt-in (``configure``) and never polls an NCCL group's works.
Unit tests drive a ``Watchdog`` with fake works and a fake clock (no thread, no real time);
one test runs the thread itself; one runs on a Gloo pool (nothing may start there); one runs
on the ``strict_async`` backend (NCCL's semantics), where rank 1 skips an all-reduce that
rank 0 issues through flatshard, and rank 0 must name it within a few seconds.
"""

from __future__ import annotations

import datetime
import threading
import time
import uuid

import pytest
import torch
import torch.distributed as dist

import flatshard as fs
from dist_pool import CASE_TIMEOUT_S
from flatshard.comm import collective_log, watchdog
from flatshard.comm.watchdog import CollectiveHang, Watchdog, bound_s
from nccl_pool import strict_pools  # noqa: F401 (the fixture)

LABEL = "unit 3 (Block) group 0"
TWO_S = datetime.timedelta(seconds=2)


class FakeWork:
    def __init__(self, done: bool = False) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done


class FakeGroup:
    """What ``group_timeout_s`` reads from a process group written in Python."""

    _device_types = ()

    def __init__(self, timeout_s: float) -> None:
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self.aborted = 0

    def abort(self) -> None:
        self.aborted += 1


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(autouse=True)
def no_process_watchdog():
    """No test leaves the process's watchdog (or its thread) behind."""
    collective_log.resize(collective_log.DEFAULT_SIZE)
    yield
    watchdog.reset()
    collective_log.resize(collective_log.DEFAULT_SIZE)


# ---- unit tests: fake works, fake clock ---------------------------------------------------------
def test_a_completed_collective_is_never_reported(clock, capsys) -> None:
    dog = Watchdog(timeout_s=10, clock=clock)
    quick, slow = FakeWork(), FakeWork()
    dog.watch(quick, "all_gather", LABEL)
    dog.watch(slow, "reduce_scatter", LABEL)
    clock.now = 5
    quick.done = True  # completes within its bound
    assert dog.poll() == [] and dog.in_flight() == 1
    clock.now = 9.5
    slow.done = True  # completes just before its bound
    for clock.now in (10.5, 100, 10_000):
        assert dog.poll() == []
    assert dog.in_flight() == 0 and dog.reports == [] and dog.pending is None
    assert capsys.readouterr().err == ""


def test_a_stuck_collective_is_reported_once_with_rank_op_label(clock, capsys) -> None:
    dog = Watchdog(timeout_s=10, clock=clock)
    stuck = FakeWork()
    dog.watch(stuck, "all_reduce", LABEL)
    clock.now = 1
    behind = [FakeWork(), FakeWork()]  # issued after it: stalled by it on NCCL's stream
    for work in behind:
        dog.watch(work, "all_gather", "bucket 0")
    clock.now = 9.9
    assert dog.poll() == []
    fired = [m for clock.now in (10.1, 11, 12, 60, 600) for m in dog.poll()]
    assert len(fired) == 1 and dog.reports == fired, fired
    message = fired[0]
    assert message.startswith(f"[flatshard rank 0] watchdog: all_reduce '{LABEL}' over ranks")
    assert "has not completed 10.1 s after it was issued (2 more" in message, message
    assert "FLATSHARD_DEBUG=1" in message and "died, hung, or taken another code path" in message
    assert capsys.readouterr().err.count("watchdog: all_reduce") == 1
    assert isinstance(dog.pending, CollectiveHang) and str(dog.pending) == message


def test_the_bound_is_below_the_group_timeout(clock) -> None:
    assert bound_s(600, 600, 0.5) == 480  # the defaults: flatshard's 600 s = NCCL's 10 min
    assert bound_s(2, 600, 0.5) == 2  # a smaller flatshard timeout wins
    assert bound_s(600, 1800, 0.5) == 600  # and a larger group timeout leaves it alone
    assert bound_s(600, None, 0.5) == 600  # unreadable: flatshard's
    for group_s in (0.8, 1.5, 5, 60, 600, 1800, 86_400):
        for flatshard_s in (1, 60, 600, 3600):
            bound = bound_s(flatshard_s, group_s, 0.5)
            assert bound <= flatshard_s and bound < group_s, (flatshard_s, group_s)
            # 20% of the group's timeout early, and two polls (a tiny timeout: one poll)
            margin = max(0.2 * group_s, 2 * 0.5)
            assert group_s - bound >= margin - 1e-9 or bound == 0.5, (flatshard_s, group_s)
    # The group's timeout, read from the group, decides when a stuck collective is reported.
    dog = Watchdog(timeout_s=600, clock=clock)
    dog.watch(FakeWork(), "reduce_scatter", LABEL, FakeGroup(600))
    clock.now = 479
    assert dog.poll() == []
    clock.now = 481
    (message,) = dog.poll()
    assert "Bound 480 s" in message and "own timeout is 600 s" in message, message


def test_the_main_thread_gets_the_hang_once_and_learns_flatshards_timeout(clock) -> None:
    dog = watchdog.configure(timeout_s=600, interval_s=3600, clock=clock)  # the thread idles
    watchdog.check(TWO_S)  # a flatshard wait: the engine's timeout reaches the watchdog
    assert dog.timeout_s == 2
    watchdog.watch(FakeWork(), "all_gather", LABEL)
    clock.now = 2.5
    (message,) = dog.poll()
    with pytest.raises(CollectiveHang) as raised:
        watchdog.check(TWO_S)
    assert str(raised.value) == message
    watchdog.check(TWO_S)  # once: the next wait goes on (it may still complete)


def test_the_actions(clock) -> None:
    group = FakeGroup(600)
    for action, aborts, raises in (("abort", 1, True), ("report", 0, False)):
        dog = Watchdog(action=action, timeout_s=1, clock=clock)
        dog.watch(FakeWork(), "all_reduce", LABEL, group)
        clock.now += 2
        (message,) = dog.poll()
        assert group.aborted == aborts and (dog.pending is not None) == raises, action
        assert f"FLATSHARD_WATCHDOG={action}" in message
        group.aborted = 0
    off = Watchdog(action="off")
    off.watch(FakeWork(), "all_reduce", LABEL)
    off.start()
    assert off.in_flight() == 0 and not off.running()
    with pytest.raises(ValueError, match="FLATSHARD_WATCHDOG='loud'"):
        Watchdog(action="loud")


def test_the_thread_reports_by_itself_and_stops() -> None:
    dog = watchdog.configure(timeout_s=0.2, interval_s=0.05, action="report")
    (thread,) = [t for t in threading.enumerate() if t.name == watchdog.THREAD_NAME]
    assert thread.daemon  # never keeps a finished process alive
    watchdog.watch(FakeWork(), "all_gather", LABEL)
    deadline = time.monotonic() + 5
    while not dog.reports and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(dog.reports) == 1, "the thread did not report the stuck collective"
    watchdog.reset()
    assert not thread.is_alive() and watchdog.current() is None


# ---- off Gloo by default: a record, no thread, no query of the work ----------------------------
class UnqueriedWork:
    """A work that must never be queried from Python (what an NCCL work is to flatshard)."""

    def is_completed(self) -> bool:
        raise AssertionError("a CUDA work was queried from Python")


def test_by_default_a_collective_is_recorded_and_never_polled(clock) -> None:
    watchdog.adopt("raise", 600.0)  # what fs.shard does
    for n in range(3):
        collective_log.record("all_gather", LABEL, clock=clock)  # what watch() appends
        watchdog.watch(UnqueriedWork(), "reduce_scatter", f"unit {n}")
    dog = watchdog.current()
    assert dog.in_flight() == 0 and not dog.running() and not dog.polls
    assert not [t for t in threading.enumerate() if t.name == watchdog.THREAD_NAME]
    assert [(r.op, r.label) for r in collective_log.records()][-2:] == [
        ("all_gather", LABEL),
        ("reduce_scatter", "unit 2"),
    ]
    watchdog.adopt("off", 600.0)
    watchdog.watch(UnqueriedWork(), "all_reduce", "unit 9")
    assert collective_log.records()[-1].label == "unit 2"  # off: nothing recorded


def test_a_polling_watchdog_never_polls_an_nccl_group(monkeypatch) -> None:
    dog = watchdog.configure(interval_s=3600)  # polls, but idles here
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    watchdog.watch(UnqueriedWork(), "all_gather", LABEL, FakeGroup(600))
    assert dog.in_flight() == 0 and collective_log.records()[-1].label == LABEL
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "strict_async")
    watchdog.watch(FakeWork(), "all_gather", LABEL, FakeGroup(600))
    assert dog.in_flight() == 1  # a host-side work: polled


def test_the_log_names_the_last_collectives_each_unit_issued(clock) -> None:
    collective_log.resize(5)
    for n in range(8):  # the ring keeps the newest five
        clock.now = float(n)
        collective_log.record("all_gather" if n % 2 else "reduce_scatter", f"unit {n % 3}",
                              clock=clock)  # fmt: skip
    assert [r.issued for r in collective_log.records()] == [3.0, 4.0, 5.0, 6.0, 7.0]
    text = collective_log.dump(now=10.0)
    lines = text.splitlines()
    assert lines[0].startswith("[flatshard rank 0] the last collectives each unit issued (5")
    # Units ordered by their newest collective: the one that stopped first comes first.
    assert [line.split(":")[0].strip() for line in lines[1:]] == [
        "unit 2", "unit 0", "unit 0", "unit 1", "unit 1"]  # fmt: skip
    assert "unit 1: all_gather seq ? over ranks" in lines[-1], lines[-1]
    assert lines[-1].endswith("issued 3.0 s ago"), lines[-1]
    recorder = collective_log.dump(now=10.0, flight_recorder=True).splitlines()[-1]
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" in recorder or "TORCH_NCCL_DUMP_ON_TIMEOUT" in recorder
    collective_log.resize(0)
    collective_log.record("all_gather", LABEL, clock=clock)
    assert collective_log.records() == []


# ---- real process groups ------------------------------------------------------------------------
def _flatshard_collectives_on_gloo() -> dict:
    from flatshard.comm import collectives

    stats, world = collectives.CommStats(), dist.get_world_size()
    for p2p in (True, False):  # flatshard's point-to-point ring and Gloo's own collectives
        stats.p2p = p2p
        full, out = torch.ones(4 * world), torch.empty(4)
        collectives.reduce_scatter_sum(out, full, dist.group.WORLD, stats, LABEL).wait(TWO_S)
        gathered = torch.empty(4 * world)
        collectives.all_gather_into(gathered, out, dist.group.WORLD, stats, LABEL).wait(TWO_S)
    collectives.all_reduce_sum(torch.ones(2), dist.group.WORLD, stats, LABEL).wait(TWO_S)
    threads = [t.name for t in threading.enumerate() if t.name == watchdog.THREAD_NAME]
    # What the group's own watchdog uses, read as for NCCL (the backend's options).
    timeout_s = watchdog.group_timeout_s(dist.group.WORLD)
    started = watchdog.current() is not None and watchdog.current().started  # (fs.shard adopts)
    return {"watchdog": started, "threads": threads, "timeout": timeout_s}


def test_nothing_starts_on_gloo(dist_pools) -> None:
    for rank, got in enumerate(dist_pools(2).run(_flatshard_collectives_on_gloo)):
        assert got == {"watchdog": False, "threads": [], "timeout": CASE_TIMEOUT_S}, (rank, got)


# ---- the switches come from fs.shard ------------------------------------------------------------
def test_fs_shard_hands_its_switches_to_the_process_watchdog() -> None:
    watchdog.adopt("report", 7.0)  # what fs.shard does with the switches it read
    dog = watchdog.current()
    assert dog is not None and (dog.action, dog.timeout_s) == ("report", 7.0)
    assert not dog.running()  # the thread waits for a collective off Gloo
    watchdog.adopt("off", 9.0)  # a later fs.shard: its switches
    assert watchdog.current() is dog and (dog.action, dog.timeout_s) == ("off", 9.0)
    with pytest.raises(ValueError, match="FLATSHARD_WATCHDOG='loud'"):
        watchdog.adopt("loud", 1.0)


def case_shard_reads_the_watchdog_switches() -> dict:
    """fs.shard reads FLATSHARD_WATCHDOG and the timeout; the environment later changes
    nothing; on Gloo no thread starts."""
    from flatshard.core.state import get_state
    from parity_models import CASES
    from patching import patched_env

    watchdog.reset()
    torch.manual_seed(0)
    case = CASES["gpt_tied"]
    with patched_env(FLATSHARD_WATCHDOG="report", FLATSHARD_TIMEOUT_S="37"):
        model = fs.shard(case.build(), policy=case.policy())
    with patched_env(FLATSHARD_WATCHDOG="abort", FLATSHARD_TIMEOUT_S="5"):
        case.loss(model, case.batch(torch.Generator().manual_seed(0), 2)).backward()
    dog = watchdog.current()
    threads = [t.name for t in threading.enumerate() if t.name == watchdog.THREAD_NAME]
    switches = get_state(model).switches  # white-box: the switches fs.shard read
    watchdog.reset()
    return {"action": dog.action, "timeout": dog.timeout_s, "threads": threads,
            "switch": "switch FLATSHARD_WATCHDOG=report" in switches.describe()}  # fmt: skip


def test_shard_reads_the_watchdog_switches_once(dist_pools) -> None:
    for rank, got in enumerate(dist_pools(2).run(case_shard_reads_the_watchdog_switches)):
        expected = {"action": "report", "timeout": 37.0, "threads": [], "switch": True}
        assert got == expected, (rank, got)


def case_shard_with(env_on_rank_1: dict, timeout_on_rank_1: float | None) -> str:
    """fs.shard where rank 1 has ``env_on_rank_1`` and ``timeout_s=timeout_on_rank_1``: the
    error every rank gets ("" when it shards)."""
    from parity_models import CASES
    from patching import patched_env

    rank_1 = dist.get_rank() == 1
    case = CASES["gpt_tied"]
    with patched_env(**(env_on_rank_1 if rank_1 else {})):
        try:
            fs.shard(
                case.build(), policy=case.policy(), timeout_s=timeout_on_rank_1 if rank_1 else None
            )
        except ValueError as err:
            return str(err)
        finally:
            watchdog.reset()
    return ""


@pytest.mark.parametrize(
    ("env", "timeout", "named"),
    [
        ({"FLATSHARD_WATCHDOG": "off"}, None, "switch FLATSHARD_WATCHDOG=off"),
        ({"FLATSHARD_TIMEOUT_S": "30"}, None, "timeout_s=30"),
        ({}, 45.0, "timeout_s=45"),
    ],
)
def test_a_rank_with_other_watchdog_switches_fails_at_shard(dist_pools, env, timeout, named):
    for message in dist_pools(2).run(case_shard_with, env, timeout):
        assert "ranks disagree" in message and named in message, message


def case_bad_watchdog_action() -> str:
    from parity_models import CASES
    from patching import patched_env

    case = CASES["gpt_tied"]
    with patched_env(FLATSHARD_WATCHDOG="loud"):
        try:
            fs.shard(case.build(), policy=case.policy())
        except ValueError as err:
            return str(err)
    return ""


def test_an_unknown_watchdog_action_fails_at_shard_on_every_rank(dist_pools) -> None:
    for message in dist_pools(2).run(case_bad_watchdog_action):
        assert "FLATSHARD_WATCHDOG='loud': use one of raise, abort, report, off" in message


def _rank_1_skips_an_all_reduce(key: str) -> dict:
    """Rank 0 issues an all-reduce through flatshard that rank 1 does not issue until rank 0
    has seen the watchdog's message (then it does: the pool stays in step)."""
    import contextlib
    import io
    import logging

    from flatshard.comm import collectives

    rank, store = dist.get_rank(), dist.distributed_c10d._get_default_store()
    stats, world = collectives.CommStats(), dist.group.WORLD
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("flatshard.watchdog").addHandler(handler)
    err = io.StringIO()
    dog = watchdog.configure(interval_s=0.1)  # the default action: raise
    try:
        with contextlib.redirect_stderr(err):
            # Both ranks: a first collective; its wait gives the watchdog flatshard's timeout.
            collectives.all_reduce_sum(torch.ones(2), world, stats, "warm-up").wait(TWO_S)
            out = _skip(rank, store, key, dog, collectives.all_reduce_sum, stats)
    finally:
        logging.getLogger("flatshard.watchdog").removeHandler(handler)
        watchdog.reset()
    return {**out, "reports": dog.reports, "stderr": err.getvalue(), "logged": records}


def _skip(rank: int, store, key: str, dog, all_reduce_sum, stats) -> dict:
    tensor = torch.ones(3)
    if rank == 1:
        store.wait([key])  # until rank 0 has checked
        all_reduce_sum(tensor, dist.group.WORLD, stats, LABEL).wait(TWO_S)
        return {"sum": tensor.tolist()}
    start = time.monotonic()
    pending = all_reduce_sum(tensor, dist.group.WORLD, stats, LABEL)
    try:  # NCCL's host runs ahead of a collective: here it polls for the report instead
        while not dog.reports and time.monotonic() - start < 10:
            time.sleep(0.02)
        seen_after = time.monotonic() - start
    finally:
        store.set(key, "checked")  # rank 1 issues the all-reduce late: nothing stays stuck
    raised = None
    try:
        pending.wait(TWO_S)
    except CollectiveHang as error:
        raised = str(error)
    pending.wait(TWO_S)  # the hang is raised once; the collective then completes
    return {"sum": tensor.tolist(), "seen_after": seen_after, "raised": raised}


def _in_step() -> list[float]:
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    return tensor.tolist()


def test_rank_0_names_the_all_reduce_rank_1_skipped(strict_pools) -> None:  # noqa: F811
    pool = strict_pools(2)
    got = pool.run(_rank_1_skips_an_all_reduce, f"watchdog-{uuid.uuid4().hex}")
    zero, one = got
    assert zero["sum"] == one["sum"] == [2.0] * 3, got  # completed once rank 1 issued it
    assert one["reports"] == [] and one["stderr"] == "", one  # its collectives completed
    (message,) = zero["reports"]
    # Not before its 2 s bound (the report itself shows it fired within the 10 s poll; no
    # upper bound here: timings live in bench/, a loaded box only delays the report).
    assert zero["seen_after"] >= 2.0, zero["seen_after"]
    assert message.startswith(
        f"[flatshard rank 0] watchdog: all_reduce '{LABEL}' over ranks [0, 1]"
    )
    assert (
        f"Bound 2 s: flatshard's timeout is 2 s; the process group's own timeout is "
        f"{CASE_TIMEOUT_S:g} s" in message
    ), message
    assert zero["stderr"] == message + "\n" and zero["logged"] == [message]
    assert zero["raised"] == message
    assert pool.run(_in_step) == [[2.0], [2.0]]  # the pool is still in step
