"""Ctrl-C on rank 0 while its main thread runs one of the engine's cycles (it waits for a handle, so it runs
them itself): the script's own ``except KeyboardInterrupt`` runs once the cycle is over, and rank 1 gets a
ShutdownError naming rank 0 when rank 0 exits. It used to abort the whole job ("the engine thread on rank 0
failed"): the interrupt left the other rank in a collective rank 0 abandoned half way.

The SIGINT is sent by a thread of rank 0 the moment the main thread is inside a cycle (aiacc's own flag of
that), so it lands there every time, not by luck of timing.
"""

import os
import signal
import threading
import time

import numpy as np

import aiacc
from aiacc import engine as engine_module
from report import say

aiacc.init()
r = aiacc.rank()
if r == 0:
    def interrupt_inside_a_cycle():
        time.sleep(0.5)  # a few steps first
        while not engine_module._MAIN_CYCLE[0]:
            time.sleep(0)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_inside_a_cycle, daemon=True).start()
step = 0
try:
    for step in range(1_000_000):
        out = aiacc.allreduce(np.full(1000, float(r)), op=aiacc.Sum, name="x")
        assert out[0] == 1.0, out[0]
        if r == 1:
            time.sleep(0.001)
except KeyboardInterrupt:
    say(f"INTERRUPTED rank={r} after {step} steps")
except aiacc.ShutdownError as exc:
    say(f"SHUTDOWN-SEEN rank={r}: {exc}")
