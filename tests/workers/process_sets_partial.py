"""A process set added on some ranks only: the ranks that called ``add_process_set`` waited in its allgather for ever
(past the stall shutdown, which watches the engines), the job hung. Run with 3 ranks and a stall shutdown of a few
seconds: ranks 0 and 2 add a set, rank 1 does not; their ``add_process_set`` raises StallError at the stall shutdown
naming rank 1 (it said "some rank") and saying the call is collective, a later one raises the same at once, and the
job goes on (the engines still reduce) and ends."""

import time

import numpy as np
from mpi4py import MPI

import aiacc
from report import raises, say

aiacc.init()
r, n = aiacc.rank(), aiacc.size()
limit = float(aiacc.engine_for(None).config.stall_shutdown_seconds)
checks = 0
if r != 1:
    start = time.monotonic()
    for attempt in range(2):
        text = raises(aiacc.StallError, lambda: aiacc.add_process_set([0, 1]), f"add_process_set on rank {r} waited",
                      "and rank 1 did not", "collective over every rank of the job")
        say(f"ERROR-SEEN rank={r} attempt {attempt}: {text}")
        checks += 1
    waited = time.monotonic() - start
    assert limit <= waited < limit + 60, (waited, limit)  # (the first waited the limit, the second not again)
    checks += 1
# every rank reduces on: the engines never took part (rank 1 waits for the others outside aiacc first: its engine's own
# stall shutdown, as short, is not what this job checks)
MPI.COMM_WORLD.Barrier()
total = aiacc.allreduce(np.full(3, r + 1.0), op=aiacc.Sum, name="after")
assert np.array_equal(total, np.full(3, n * (n + 1) / 2)), total
checks += 1
say(f"OK rank={r} checks={checks}")
aiacc.shutdown()
