"""Rank 1 ends in the way the command line names while rank 0 waits for it: 'before-init' (sys.exit before
aiacc.init), 'kill' (SIGKILL in an allreduce loop), 'os-exit' (os._exit(5) there) or 'os-exit-0' (os._exit(0))."""

import os
import signal
import sys

how = sys.argv[1]
if how == "before-init" and os.environ.get("RANK") == "1":
    sys.exit("rank 1: cannot read data.csv")

import numpy as np  # noqa: E402

import aiacc  # noqa: E402

aiacc.init()
for step in range(50):
    if aiacc.rank() == 1 and step == 3:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(0 if how == "os-exit-0" else 5)
    aiacc.allreduce(np.ones(4), name="g")
raise AssertionError("rank 0 went on without rank 1")
