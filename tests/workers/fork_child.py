"""Every rank forks after init(); the child (no rank of the job) tries a collective and waits for one the parent
had pending, then exits through sys.exit (atexit runs there). The child gets an error saying it is a forked
process; the parents' collectives go on right; the children's exit hangs nothing."""

import os
import sys

import numpy as np

import aiacc
from report import say

checks = 0


def check(what, got, want):
    global checks
    assert np.array_equal(got, want), f"rank {aiacc.rank()}: {what}: {got} != {want}"
    checks += 1


aiacc.init()
r, n = aiacc.rank(), aiacc.size()
check("before the fork", aiacc.allreduce(np.full(3, float(r)), op=aiacc.Sum, name="a"), np.full(3, n * (n - 1) / 2))
pending = aiacc.allreduce_async(np.ones(2), op=aiacc.Sum, name="pending") if r == 0 else None
pid = os.fork()
if pid == 0:
    errors = []
    try:
        aiacc.allreduce(np.ones(2), name="child")
    except aiacc.AiaccError as exc:
        errors.append(str(exc))
    if pending is not None:
        try:
            aiacc.synchronize(pending)
        except aiacc.AiaccError as exc:
            errors.append(str(exc))
    want = 2 if pending is not None else 1
    ok = len(errors) == want and all(f"aiacc cannot be used in a process forked from rank {r} after aiacc.init()"
                                     in e for e in errors)
    print(f"CHILD of rank {r}: {'refused' if ok else errors}", flush=True)
    sys.exit(0 if ok else 1)  # (atexit runs: no shutdown, no MPI_Finalize of the parent's MPI)
if pending is None:
    pending = aiacc.allreduce_async(np.ones(2), op=aiacc.Sum, name="pending")
check("pending across the fork", aiacc.synchronize(pending), np.full(2, float(n)))
for i in range(20):
    check(f"after the fork {i}", aiacc.allreduce(np.full(4, float(r + i)), op=aiacc.Sum, name=f"b{i % 3}"),
          np.full(4, n * i + n * (n - 1) / 2))
_, status = os.waitpid(pid, 0)
check("the child's exit status", np.array([os.waitstatus_to_exitcode(status)]), np.array([0]))
say(f"OK rank={r} checks={checks}")
