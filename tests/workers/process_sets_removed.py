"""An operation pending on a process set when the set is removed fails saying so on every member, whichever
member's engine stops first.

Run with 3 ranks. Rank 2 has an allreduce pending on the set of ranks 0 and 2, which rank 0 never submits; every
rank removes the set. Rank 2's main thread is held up between agreeing on the removal and stopping its engine
(a busy rank on a loaded machine), so rank 0 stops first: rank 2's engine then stopped for rank 0's request and
its error read "aiacc was shut down by rank 0 (shutdown() or the end of the script)", which rank 0 never called.
"""

import time

import numpy as np

import aiacc
from report import raises, say

aiacc.init()
r, n = aiacc.rank(), aiacc.size()
assert n == 3
pair = aiacc.add_process_set([0, 2])
lonely = None
if r == 2:
    lonely = aiacc.allreduce_async(np.ones(2), name="lonely", process_set=pair)
    engine = aiacc.engine_for(pair)
    stop = engine.shutdown

    def late_stop(*args, **kwargs):
        time.sleep(1.0)  # (rank 0's engine stops meanwhile, and with it the set's cycles on this rank)
        return stop(*args, **kwargs)

    engine.shutdown = late_stop
set_id = pair.process_set_id
assert aiacc.remove_process_set(pair)
checks = 0
if lonely is not None:
    raises(aiacc.ShutdownError, lambda: aiacc.synchronize(lonely),
           f"allreduce of tensor 'lonely' on rank 2 did not complete: process set {set_id} (ranks [0, 2]) was removed "
           "(remove_process_set)")
    checks += 1
assert (aiacc.allreduce(np.ones(1), op=aiacc.Sum, name="after") == n).all()
say(f"OK rank={r} checks={checks + 1}")
