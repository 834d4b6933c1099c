"""Ranks that judge the link differently still complete large allreduces.

Each rank picks how it waits for a large allreduce from the bandwidth it has
measured itself: one rank may take the link for a network (polling) while the
other takes it for shared memory. Both must post the same kind of MPI call (a
blocking MPI_Allreduce never matches an MPI_Iallreduce: MPICH hung both ranks
in CI). Rank 0 is told its link is slow, rank 1 that it is fast.
"""

import numpy as np

import aiacc
from report import say

aiacc.init()
r, n = aiacc.rank(), aiacc.size()
transport = aiacc.get_engine().transport
transport.achieved_rate = 1e6 if r == 0 else 1e12
for step in range(20):
    x = np.full(3 << 20, float(r + 1 + step), dtype=np.float32)  # 12 MiB: the large path
    got = aiacc.allreduce(x, op=aiacc.Sum, name="big")
    want = n * (n + 1) / 2 + n * step
    assert got[0] == want and got[-1] == want, f"step {step}: {got[0]} != {want}"
    transport.achieved_rate = 1e6 if r == 0 else 1e12  # keep the two judgements apart
say(f"OK rank={r}")
