"""Framework-free (aiacc's core, as the TensorFlow and MXNet states commit): an ObjectState holding a 128 MB
array, committed as the script's last line, after ``elastic.run`` returned.

``commit``: the commit of ``step=7`` and an array of ones. ``check`` (the next start, same AIACC_ELASTIC_DIR):
prints ``RESUMED rank=R step=S total=T`` from what ``run`` loaded."""

import sys

import numpy as np

import aiacc
from aiacc import elastic

aiacc.init()
state = elastic.ObjectState(step=0, big=np.zeros(1 << 24))


@elastic.run
def train(state):
    if sys.argv[1] == "check":
        print(f"RESUMED rank={aiacc.rank()} step={state.step} total={float(state.big.sum())}", flush=True)


train(state)
if sys.argv[1] == "commit":
    state.step = 7
    state.big[:] = 1.0
    state.commit()  # the script's last line
