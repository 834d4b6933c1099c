"""aiacc switched off: rank 0 of 1, MPI never started, collectives return their input."""

import sys

import numpy as np

import aiacc
from report import say

assert not aiacc.is_enabled()
aiacc.init()
assert (aiacc.rank(), aiacc.size(), aiacc.local_rank(), aiacc.local_size()) == (0, 1, 0, 1)
assert (aiacc.cross_rank(), aiacc.cross_size()) == (0, 1)
x = np.arange(6, dtype=np.float32).reshape(2, 3)
for fn in (lambda: aiacc.allreduce(x, op=aiacc.Sum, prescale_factor=3.0), lambda: aiacc.allgather(x),
           lambda: aiacc.broadcast(x, 0), lambda: aiacc.reducescatter(x), lambda: aiacc.alltoall(x)):
    out = fn()
    assert np.array_equal(out, x) and out is not x, out
out, splits = aiacc.alltoall(x, splits=[2])
assert np.array_equal(out, x) and list(splits) == [2]
assert [a.tolist() for a in aiacc.grouped_allreduce([x, x])] == [x.tolist(), x.tolist()]
assert np.array_equal(aiacc.synchronize(aiacc.allreduce_async(x)), x)
aiacc.barrier()
assert aiacc.join() == 0
assert "mpi4py.MPI" not in sys.modules, "MPI was started although aiacc is disabled"
aiacc.shutdown()
say("OK rank=0")
