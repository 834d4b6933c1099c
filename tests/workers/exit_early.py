"""Rank 1 exits with the status given on the command line while the other ranks wait for it in an allreduce."""

import sys

import numpy as np

import aiacc

aiacc.init()
if aiacc.rank() == 1:
    sys.exit(int(sys.argv[1]))
aiacc.allreduce(np.ones(2), name="x")
raise AssertionError("the allreduce completed without rank 1")
