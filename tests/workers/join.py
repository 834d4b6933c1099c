"""join(): a rank with no more data takes part in the others' allreduces with the identity of their op.

Each round one rank joins first; the others allreduce (names seen before, so agreed through the
response cache, and new names), grouped too, with fp16 compression too, then try a broadcast and an
allgather (an error on every rank while a rank has joined), then join. References are computed from
the contributing ranks' inputs: Sum, Min, Max, Product over them; Average = their sum / the job's
size (Horovod's meaning: the joined rank contributes zeros), integers rounded toward zero.
"""

import sys

import numpy as np

import aiacc
from report import raises, say

aiacc.init()
r, n = aiacc.rank(), aiacc.size()
checks = 0
OPS = (aiacc.Sum, aiacc.Average, aiacc.Min, aiacc.Max, aiacc.Product)


def data(rank, dtype, seed):
    rng = np.random.default_rng(seed * 100 + rank)
    if np.dtype(dtype) == np.bool_:
        return rng.integers(0, 2, size=7).astype(bool)
    if np.dtype(dtype).kind == "i":
        return rng.integers(-9, 10, size=7).astype(dtype)
    return (rng.random(7) * 4 - 2).astype(dtype)


def reference(op, xs, dtype):
    xs = np.stack(xs).astype(np.float64)
    if op == aiacc.Average:
        total = xs.sum(axis=0) / n
        return (np.trunc(total) if np.dtype(dtype).kind == "i" else total).astype(dtype)
    red = {aiacc.Sum: np.sum, aiacc.Min: np.min, aiacc.Max: np.max, aiacc.Product: np.prod}[op]
    return red(xs, axis=0).astype(dtype)


def check(label, got, want, tolerance=None):
    global checks
    if tolerance is None:  # floats: the rounding of a sum in another order; integers and bools: exact
        tolerance = {np.dtype(np.float32): 1e-6, np.dtype(np.float64): 1e-12}.get(want.dtype, 0.0)
    assert got.dtype == want.dtype and got.shape == want.shape, (label, got.dtype, want.dtype)
    assert np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=tolerance, atol=tolerance), \
        f"{label}: {got} != {want}"
    checks += 1


cases = [(op, dtype) for op in OPS for dtype in (np.float32, np.float64, np.int32, np.int64)]
cases += [(op, np.bool_) for op in (aiacc.Sum, aiacc.Min, aiacc.Max, aiacc.Product)]
# every name once with every rank present: later rounds find them in the response cache
for op, dtype in cases:
    aiacc.allreduce(data(r, dtype, 0), op=op, name=f"cached.{op}.{np.dtype(dtype).name}")
aiacc.broadcast(np.zeros(3), 0, name="cached.bcast")
aiacc.allgather(np.zeros(3), name="cached.gather")

for first in range(n):
    others = [k for k in range(n) if k != first]
    if r == first:
        last = aiacc.join()
    else:
        for cached in (True, False):
            for op, dtype in cases:
                prefix = "cached" if cached else f"new{first}"
                got = aiacc.allreduce(data(r, dtype, first), op=op, name=f"{prefix}.{op}.{np.dtype(dtype).name}")
                check(f"{prefix} {op} {np.dtype(dtype).name} first={first}", got,
                      reference(op, [data(k, dtype, first) for k in others], dtype))
        g = aiacc.grouped_allreduce([data(r, np.float32, 7), data(r, np.int64, 8)], op=aiacc.Max, name="group")
        check("grouped float32", g[0], reference(aiacc.Max, [data(k, np.float32, 7) for k in others], np.float32))
        check("grouped int64", g[1], reference(aiacc.Max, [data(k, np.int64, 8) for k in others], np.int64))
        x = (np.arange(100, dtype=np.float32) / 7) * (r + 1)
        got = aiacc.allreduce(x, op=aiacc.Sum, name="fp16", compression=aiacc.Compression.fp16)
        check("fp16 compression", got, sum(np.arange(100, dtype=np.float32) / 7 * (k + 1) for k in others), 2e-2)
        for label, fn in (("cached.bcast", lambda: aiacc.broadcast(np.zeros(3), 0, name="cached.bcast")),
                          ("new.bcast", lambda: aiacc.broadcast(np.zeros(3), 0, name=f"new.bcast.{first}")),
                          ("cached.gather", lambda: aiacc.allgather(np.zeros(3), name="cached.gather"))):
            raises(aiacc.TensorMismatchError, fn, repr(label.replace("new.bcast", f"new.bcast.{first}")),
                   f"cannot run while rank {first} has called join(); only allreduce can")
            checks += 1
        last = aiacc.join()
    everyone = aiacc.allgather(np.array([last], np.int64), name=f"last.{first}")
    assert last != first and (everyone == last).all(), (first, last, everyone)
    checks += 1
# a thread's collective (a metrics thread) after its rank called join(): never run, it failed at the shutdown with
# advice to call join(); now refused at once. And join() again from a thread while the first waits: named. Ordered by
# MPI messages outside aiacc: rank 1 tells rank 0's thread once its allreduce has run with rank 0 joined
import threading  # noqa: E402

from mpi4py import MPI  # noqa: E402

if r == 0:
    seen = []

    def late_metric():
        MPI.COMM_WORLD.recv(source=1, tag=11)  # (rank 0 has joined: rank 1's allreduce ran without it)
        seen.append(raises(aiacc.InvalidArgumentError, lambda: aiacc.allreduce(np.ones(1), name="late.metric"),
                           "allreduce of tensor 'late.metric' was submitted on rank 0 after this rank called join()",
                           "submit it before join(), or after join() returns"))
        seen.append(raises(aiacc.DuplicateNameError, aiacc.join, "join() was called on rank 0 while an earlier "
                           "join() of this rank (on another thread) still waits for the other ranks"))
        MPI.COMM_WORLD.send("tried", dest=1, tag=12)

    thread = threading.Thread(target=late_metric)
    thread.start()
    aiacc.join()
    thread.join()
    assert len(seen) == 2, seen
    checks += 2
else:
    got = aiacc.allreduce(np.full(2, r + 1.0), op=aiacc.Sum, name="without.rank0")
    check("allreduce while rank 0 joined", got, np.full(2, sum(k + 1.0 for k in range(1, n))))
    if r == 1:
        MPI.COMM_WORLD.send("joined", dest=0, tag=11)
        MPI.COMM_WORLD.recv(source=0, tag=12)
    aiacc.join()
after = aiacc.allreduce(np.full(2, r + 1.0), op=aiacc.Sum, name="after.late.join")
check("allreduce after the join", after, np.full(2, n * (n + 1) / 2))
aiacc.barrier()
say(f"OK rank={r} checks={checks}")
aiacc.shutdown()
sys.exit(0)
