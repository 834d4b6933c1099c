"""A ProcessSet object that no longer names a registered set is refused, never run on another set.

Run with 3 ranks. A set registered by ``init(process_sets=[ps])`` is held twice: by ``ps`` and by the table's
own entry (``process_set_by_id``). After ``shutdown()`` and ``init()`` again, or after ``remove_process_set``
through one of the two objects, the id is free and the next set added gets it. Every object of the old set
must then read ``process_set_id`` None and be refused naming it as not registered: it used to keep the id,
and a collective on it ran on the new set's engine (ranks 1 and 2 summed together for a set of ranks 0 and 1,
while rank 0, a member, was told it was not in the set).
"""

import numpy as np

import aiacc
from report import raises, say

ps = aiacc.ProcessSet([0, 1])
aiacc.init(process_sets=[ps])
r, n = aiacc.rank(), aiacc.size()
assert n == 3
checks = 0


def refused(stale, what):
    """``stale`` has no id and every collective on it is refused naming it, on every rank."""
    global checks
    assert stale.process_set_id is None, (what, stale)
    raises(ValueError, lambda: aiacc.allreduce(np.full(2, r + 1.0), op=aiacc.Sum, name=f"stale.{what}",
                                               process_set=stale),
           "is not a registered process set")
    checks += 1


# 1. shutdown() and init() again: the old set's id is given to the first set added
aiacc.shutdown()
aiacc.init()
other = aiacc.add_process_set([1, 2])
assert other.process_set_id == 1, other
refused(ps, "after.shutdown")
if other.included():  # the new set still works
    got = aiacc.allreduce(np.full(2, r + 1.0), op=aiacc.Sum, name="other", process_set=other)
    assert (got == 5.0).all(), got
    checks += 1
assert aiacc.remove_process_set(other)

# 2. a set registered by init() removed through one object: the table's own entry lets the id go too
ps2 = aiacc.ProcessSet([0, 1])
aiacc.init(process_sets=[ps2])  # (initialized already: registers ps2, collectively)
entry = aiacc.process_set_by_id(ps2.process_set_id)  # the table's own object of the set, not ps2
assert entry is not ps2 and entry.ranks == ps2.ranks, (entry, ps2)
assert aiacc.remove_process_set(ps2)
newer = aiacc.add_process_set([0, 2])
assert newer.process_set_id == 1, newer
refused(entry, "after.remove")
if newer.included():
    got = aiacc.allreduce(np.full(2, r + 1.0), op=aiacc.Sum, name="newer", process_set=newer)
    assert (got == 4.0).all(), got
    checks += 1
aiacc.barrier()
say(f"OK rank={r} checks={checks}")
