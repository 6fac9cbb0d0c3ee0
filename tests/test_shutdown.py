"""``end_process_group`` ends the default group and hands the GIL over before returning
([Note: the exit abort] in ``flatshard/comm/shutdown.py``; ``bench/bench_exit.py`` counts the
aborts it prevents)."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import sys, threading, time, torch.distributed as dist
from flatshard.comm import shutdown
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
# A thread that wants the GIL while the main thread ends the group: it must get it before
# end_process_group returns (as Gloo's runloop thread must, to drop its last work's tensors).
ran = []
waiter = threading.Thread(target=lambda: (time.sleep(0.02), ran.append(time.perf_counter())))
sys.setswitchinterval(1.0)  # without a pause, the main thread would keep the GIL for 1 s
waiter.start()
shutdown.end_process_group()
returned = time.perf_counter()
print(dist.is_initialized(), bool(ran) and ran[0] <= returned)
"""


def test_end_process_group_destroys_and_hands_the_gil_over():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]


def test_end_process_group_without_a_group_is_a_no_op():
    code = "from flatshard.comm import shutdown; shutdown.end_process_group(); print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


EXIT_SCRIPT = """
import atexit, sys, torch.distributed as dist
from flatshard.comm import shutdown
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
atexit.register(lambda: print("finalized"))  # must not run: no interpreter finalization
print("written", end="")  # still in the buffer: exit_after_group must flush it
sys.stderr.write("warned")
shutdown.exit_after_group(3)
print("after")
"""


def test_exit_after_group_flushes_and_skips_finalization():
    run = [sys.executable, "-c", EXIT_SCRIPT]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered stdout
    out = subprocess.run(run, capture_output=True, text=True, timeout=60, env=env)
    assert (out.returncode, out.stdout, out.stderr) == (3, "written", "warned"), out
