"""aiacc switched off is a job of one rank: the same results and the same errors as ``aiaccrun -np 1``.

Run twice by the test: switched off (MPI must never start) and under ``aiaccrun -np 1``. Each run
prints one RESULT line per case (a digest of what the call returned or the error it raised) and
checks the values a job of one rank must give; the test compares the two runs' lines.
Usage: disabled.py [on]   ("on": expect the engine to run)
"""

import hashlib
import sys

import numpy as np

import aiacc
from report import raises, say

engine_on = sys.argv[1:] == ["on"]
assert aiacc.is_enabled() == engine_on
# init(comm=...) that a job of one rank refuses (switched off, these were accepted); init() then still works
for label, comm, words in (("ranks", [1], ["init(comm=[1]): expected distinct ranks of MPI.COMM_WORLD, 0..0"]),
                           ("type", 5, ["init(comm=...) takes an mpi4py communicator", "got int 5"])):
    say(f"RESULT error.init.{label} {raises((TypeError, ValueError), lambda: aiacc.init(comm=comm), *words)}")
aiacc.init()
assert (aiacc.rank(), aiacc.size(), aiacc.local_rank(), aiacc.local_size()) == (0, 1, 0, 1)
assert (aiacc.cross_rank(), aiacc.cross_size()) == (0, 1)
assert aiacc.is_homogeneous()  # one rank (switched off): one host
assert aiacc.summary()["enabled"] == engine_on  # switched off: {"enabled": False}, nothing counted
g = aiacc.global_process_set
assert (g.ranks, g.size(), g.rank(), g.included()) == ([0], 1, 0, True), g

x = np.arange(6, dtype=np.float32).reshape(2, 3) + 1
xi = np.arange(6, dtype=np.int32).reshape(2, 3) - 2
xb = np.array([True, False, True])
checks = 0


def result(label, value):
    """Print a digest of ``value`` (arrays by dtype, shape and bytes)."""
    parts = value if isinstance(value, (list, tuple)) else [value]
    h = hashlib.sha1()
    for p in parts:
        a = np.asarray(p)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    say(f"RESULT {label} {h.hexdigest()}")


def expect(label, got, want):
    global checks
    assert np.array_equal(got, want) and got.dtype == want.dtype, (label, got, want)
    checks += 1
    result(label, got)


# reductions of one rank: every op gives the input; scale factors and compression apply
for op in (aiacc.Sum, aiacc.Average, aiacc.Min, aiacc.Max, aiacc.Product):
    expect(f"allreduce.{op}", aiacc.allreduce(x, op=op), x)
    expect(f"allreduce.int.{op}", aiacc.allreduce(xi, op=op), xi)
expect("allreduce.scaled", aiacc.allreduce(x, op=aiacc.Sum, prescale_factor=3.0, postscale_factor=0.5), x * 1.5)
expect("allreduce.average.scaled", aiacc.allreduce(x, prescale_factor=2.0), x * 2)
expect("allreduce.bool.max", aiacc.allreduce(xb, op=aiacc.Max), xb)
expect("allreduce.adasum", aiacc.allreduce(x, op=aiacc.Adasum, postscale_factor=2.0), x * 2)  # (one rank: itself)
big = np.float32(1.0) + np.float32(2.0 ** -12)  # not representable in fp16: the wire rounds it
expect("allreduce.fp16", aiacc.allreduce(np.full(4, big, np.float32), op=aiacc.Sum, compression=aiacc.Compression.fp16),
       np.full(4, np.float32(np.float16(big)), np.float32))
out = aiacc.allreduce(x)
assert out is not x and np.shares_memory(out, x) is False
y = x.copy()
assert aiacc.allreduce_(y, op=aiacc.Sum, postscale_factor=2.0) is y
expect("allreduce_.inplace", y, x * 2)
expect("grouped", np.concatenate([a.ravel() for a in aiacc.grouped_allreduce([x, x * 2], op=aiacc.Sum)]),
       np.concatenate([x.ravel(), (x * 2).ravel()]))
expect("async", aiacc.synchronize(aiacc.allreduce_async(x, op=aiacc.Max)), x)
expect("allgather", aiacc.allgather(x), x)
expect("broadcast", aiacc.broadcast(x, 0), x)
expect("reducescatter", aiacc.reducescatter(x, op=aiacc.Sum, prescale_factor=2.0), x * 2)
expect("alltoall", aiacc.alltoall(x), x)
rows, splits = aiacc.alltoall(x, splits=[2])
expect("alltoall.splits", rows, x)
expect("alltoall.received", np.asarray(splits), np.array([2], np.int64))
aiacc.barrier()
assert aiacc.join() == 0

# errors, as a real job of one rank gives them
for label, fn, words in (
    ("bool.average", lambda: aiacc.allreduce(xb), ["op=Average is not defined for bool"]),
    ("op.float", lambda: aiacc.allreduce(x, op=1.9), ["op=1.9 is not a reduce operation"]),
    ("op.name", lambda: aiacc.allreduce(x, op="mean"), ["op='mean' is not a reduce operation"]),
    ("root", lambda: aiacc.broadcast(x, 1), ["root_rank=1 is out of range", "valid: 0..0"]),
    ("splits", lambda: aiacc.alltoall(x, splits=[1]), ["splits [1] must be 1 non-negative numbers summing to"]),
    ("strided", lambda: aiacc.allreduce(x[:, ::2]), ["is not C-contiguous"]),
    ("dtype", lambda: aiacc.allreduce(np.zeros(2, np.clongdouble)), ["complex256", "not support"]),
    # a job of one rank has one process set, the global one: a set of rank 0 repeats it, no other can be made
    # (switched off, these were accepted, and a set never registered reduced as if it were)
    ("set.duplicate", lambda: aiacc.add_process_set([0]), ["Attempted to add a duplicate process set"]),
    ("set.ranks", lambda: aiacc.add_process_set([0, 1]), ["a process set needs distinct ranks in 0..0"]),
    ("set.unregistered", lambda: aiacc.allreduce(x, name="ps.x", process_set=aiacc.ProcessSet([0])),
     ["is not a registered process set"]),
):
    text = raises((TypeError, ValueError), fn, *words)
    checks += 1
    say(f"RESULT error.{label} {text}")
assert not aiacc.remove_process_set(aiacc.ProcessSet([0])) and not aiacc.remove_process_set(g)
assert ("mpi4py.MPI" in sys.modules) == engine_on, "MPI was started although aiacc is disabled"
aiacc.shutdown()
say(f"OK rank=0 checks={checks}")
