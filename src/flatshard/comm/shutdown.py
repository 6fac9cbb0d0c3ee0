"""Ending a worker's process group without the exit abort of Gloo's worker threads.

[Note: the exit abort]
On torch 2.13 with Gloo a worker aborts at interpreter exit in about one run in three, in a
plain torch script: init, a few ``barrier``/``all_reduce``, ``destroy_process_group``, return.
The message is "terminate called without an active exception" (SIGABRT), after all the work is
done. gdb shows a ``pt_gloo_runloop`` thread dropping a finished work's tensors, which came
from Python. That needs the GIL. The thread asks for it while the interpreter is finalizing,
so Python ends the thread from inside a C++ destructor, which is ``std::terminate``. The
runloop threads are still alive after ``destroy_process_group`` returns (measured).
cf. pytorch#179291, the same abort without ``destroy_process_group``.

So after destroying the group, the process sleeps a moment, with the GIL released, before it
may finalize. ``bench/bench_exit.py`` counts the aborts (30 runs each on the 2-core box): 6
with ``destroy_process_group`` alone (9 with the script it was distilled from), none with
:func:`end_process_group`. Every flatshard worker entry point (``flatshard train``,
``flatshard bench``, the estimator's measurement, the bench scripts) ends its group with it.
Scripts that ran the Lightning or Hugging Face trainers end with :func:`exit_after_group`:
those leave threads of their own behind, and the abort was seen there too, in a script that
never destroyed the group the HF Trainer had made (CI, session 8).
"""

from __future__ import annotations

import os
import sys
import time
from typing import NoReturn

import torch.distributed as dist

GIL_HANDOVER_S = 0.05  # > Python's 5 ms switch interval, with margin for a loaded box


def end_process_group() -> None:
    """Destroy the default process group (if any) and let Gloo's threads finish with the
    GIL before the interpreter may finalize (see the Note)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    time.sleep(GIL_HANDOVER_S)


def exit_after_group(code: int = 0) -> NoReturn:
    """Wait for every rank, end the process group, flush, and leave without the interpreter's
    finalization (for workers whose libraries leave threads behind; see the Note). Call it
    once everything is written."""
    if dist.is_initialized():
        dist.barrier()  # every rank done before any tears its group down
    end_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
