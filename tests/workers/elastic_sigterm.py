"""A framework-free hvd.elastic job (aiacc's core, numpy) whose commits are large: an ObjectState with an
8 MB array that every step adds an allreduced sum of ones to, committed after every step.

With HOLD_FILE given, rank 0 prints ``WAITING rank=0`` after the commit of step 2 and waits until HOLD_FILE
exists before committing step 3, so that a test can prepare the file that commit is written to (see
tests/test_elastic.py). Prints ``RESUME rank=R step=S`` at the start, ``COMMIT rank=R step=S`` after each
commit, and ``OK rank=R`` when the array equals STEPS x size.
Usage: elastic_sigterm.py [HOLD_FILE]"""

import os
import sys
import time

import numpy as np

import aiacc
from aiacc import elastic
from report import say

aiacc.init()
r, n = aiacc.rank(), aiacc.size()
HOLD_FILE = sys.argv[1] if len(sys.argv) > 1 else ""
STEPS, HOLD_STEP = 6, 3
state = elastic.ObjectState(step=0, total=np.zeros(1 << 20))


@elastic.run
def train(state):
    say(f"RESUME rank={r} step={state.step}")
    while state.step < STEPS:
        state.total = state.total + aiacc.allreduce(np.ones(1), name="ones", op=aiacc.Sum)
        state.step += 1
        if HOLD_FILE and r == 0 and state.step == HOLD_STEP:
            say("WAITING rank=0")
            while not os.path.exists(HOLD_FILE):  # a hand-over with the test, not a delay
                time.sleep(0.05)
        state.commit()
        say(f"COMMIT rank={r} step={state.step}")


train(state)
assert state.step == STEPS and np.all(state.total == STEPS * n), (state.step, state.total[:3])
say(f"OK rank={r}")
