"""A rank that cannot make the shared-memory window (an MPI without shared windows, here made to fail on
rank 1): every rank then reduces through MPI, with a warning naming the rank, and the results are right."""

import numpy as np

import aiacc
import aiacc.transport.shm as shm
from report import say

real_init = shm.SharedAllreduce.__init__


def init_failing_on_rank_1(self, comm, *args):
    real_init(self, comm, *args)  # (collective: made on every rank, as a failing MPI call would be entered)
    if comm.Get_rank() == 1:
        raise RuntimeError("no shared windows here")


shm.SharedAllreduce.__init__ = init_failing_on_rank_1
aiacc.init()
r, n = aiacc.rank(), aiacc.size()
assert aiacc.get_engine().executor.shared is None, "a rank kept the window while another has none"
checks = 0
for step in range(3):
    arrays = [np.full(10 + i, float(r + 1 + step), np.float32) for i in range(20)]
    handles = [aiacc.allreduce_async_(a, op=aiacc.Sum, name=f"f.{i}") for i, a in enumerate(arrays)]
    for h in handles:
        aiacc.synchronize(h)
    assert all(np.all(a == sum(k + 1 + step for k in range(n))) for a in arrays), (step, arrays[0][:3])
    checks += 1
say(f"OK rank={r} checks={checks}")
aiacc.shutdown()
