"""``end_process_group`` ends the default group and hands the GIL over before returning
([Note: the exit abort] in ``flatshard/comm/shutdown.py``; ``bench/bench_exit.py`` counts the
aborts it prevents)."""

from __future__ import annotations

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
