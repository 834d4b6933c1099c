"""Process sets: every collective among a subset of the ranks, against numpy references.

Run with 3 ranks (and 2): sets of the even and the odd ranks, each with its own engine; names may
repeat across sets; broadcast roots are ranks of the job; a rank outside a set, a duplicate set and
sets added differently on different ranks are errors naming what is wrong.
"""

import sys

import numpy as np

import aiacc
from aiacc.buckets import GradientBuckets, ParamSpec
from report import raises, say

n_hint = int(sys.argv[1])
first_set = aiacc.ProcessSet([0, 1]) if n_hint > 2 else None  # registered by init (with 2 ranks, it is everyone)
raises(ValueError, lambda: aiacc.init(process_sets="static"), "a list of ProcessSet objects or 'dynamic', got 'static'")
aiacc.init(process_sets=[first_set] if first_set else "dynamic")  # (Horovod's form 3: sets are added later)
r, n = aiacc.rank(), aiacc.size()
assert n == n_hint
checks = 0


def data(rank, shape, seed):
    return (np.random.default_rng(seed * 10 + rank).random(shape) * 10).astype(np.float64)


def check(label, got, want):
    global checks
    assert got.shape == want.shape and np.allclose(got, want), f"{label}: {got} != {want}"
    checks += 1


if first_set:
    assert first_set.process_set_id == 1 and first_set.ranks == [0, 1] and first_set.size() == 2
    assert first_set.included() == (r < 2)
    if r < 2:
        assert first_set.rank() == r
    else:  # (Horovod's error)
        raises(ValueError, first_set.rank, "rank 2 is not in process set 1 (ranks [0, 1])",
               "Process is not part of provided process set")
assert aiacc.global_process_set.ranks == list(range(n)) and aiacc.global_process_set.process_set_id == 0
even = aiacc.add_process_set(np.arange(0, n, 2))  # numpy's integers are ranks (they were "must be whole numbers")
assert even.ranks == list(range(0, n, 2)) and all(type(k) is int for k in even.ranks), even
odd = aiacc.add_process_set(aiacc.ProcessSet([k for k in range(n) if k % 2 == 1]))
mine, members = (even, even.ranks) if r % 2 == 0 else (odd, odd.ranks)
assert mine.included() and mine.rank() == members.index(r) and mine.size() == len(members)
for step in range(3):  # the same names in both sets, agreed again through each set's cache
    x = data(r, (4, 3), step)
    check("allreduce", aiacc.allreduce(x, op=aiacc.Sum, name="x", process_set=mine),
          sum(data(k, (4, 3), step) for k in members))
    check("average", aiacc.allreduce(x, name="avg", process_set=mine),
          sum(data(k, (4, 3), step) for k in members) / len(members))
    g = aiacc.grouped_allreduce([x, x[0]], op=aiacc.Max, name="g", process_set=mine)
    check("grouped", g[1], np.max([data(k, (4, 3), step)[0] for k in members], axis=0))
    check("allgather", aiacc.allgather(data(r, (r + 1, 2), step), name="ag", process_set=mine),
          np.concatenate([data(k, (k + 1, 2), step) for k in members]))
    root = members[-1]
    check("broadcast", aiacc.broadcast(x, root, name="bc", process_set=mine), data(root, (4, 3), step))
    rows = np.arange(2 * len(members), dtype=np.float64) + 100 * r
    got = aiacc.alltoall(rows, name="a2a", process_set=mine)
    check("alltoall", got, np.array([100 * k + 2 * members.index(r) + j for k in members for j in range(2)],
                                    np.float64))
    total = sum(data(k, (len(members) * 2, 2), step) for k in members)
    i = members.index(r)
    check("reducescatter", aiacc.reducescatter(data(r, (len(members) * 2, 2), step), op=aiacc.Sum, name="rs",
                                               process_set=mine), total[2 * i:2 * i + 2])
    aiacc.barrier(process_set=mine)
    # the global set at the same time
    check("global", aiacc.allreduce(np.full(2, r + 1.0), op=aiacc.Sum, name="x"), np.full(2, n * (n + 1) / 2))
if first_set and r < 2:
    check("static set", aiacc.allreduce(np.full(2, r + 7.0), op=aiacc.Sum, name="x", process_set=first_set),
          np.full(2, 15.0))
other = odd if mine is even else even
raises(ValueError, lambda: aiacc.allreduce(np.ones(2), process_set=other), f"rank {r} is not in process set")
raises(ValueError, lambda: aiacc.broadcast(np.ones(2), other.ranks[0], process_set=mine),
       f"root_rank={other.ranks[0]} is not in process set {mine.process_set_id}")
raises(ValueError, other.rank, f"rank {r} is not in process set {other.process_set_id}")
raises(ValueError, lambda: aiacc.add_process_set(even.ranks), "duplicate process set")
raises(ValueError, lambda: aiacc.add_process_set([r]), "different ranks on different ranks")
raises(ValueError, lambda: aiacc.allreduce(np.ones(2), process_set=aiacc.ProcessSet([0, 1])),
       "is not a registered process set")
checks += 6
if len(members) > 1:  # a mismatch inside a set names the ranks of the job (not the set's own numbering) and the set
    raises(aiacc.TensorMismatchError, lambda: aiacc.allreduce(np.ones(r + 1), name="odd_shape", process_set=mine),
           "tensor 'odd_shape': shape differs across ranks", f"rank {members[0]}: ({members[0] + 1},)",
           f"rank {members[1]}: ({members[1] + 1},)", f"in the process set of ranks {members}")
    # so does the first step of gradient buckets whose parameters differ (here: in number)
    specs = [ParamSpec(f"p{i}", (3,), np.dtype(np.float32)) for i in range(r + 1)]
    buckets = GradientBuckets(aiacc.engine_for(mine), specs)
    for i in range(len(specs)):
        buckets.ready(i, np.ones(3, np.float32))
    raises(aiacc.TensorMismatchError, buckets.wait, "number of gradients to average differs across ranks",
           f"rank {members[0]}: {members[0] + 1}; rank {members[1]}: {members[1] + 1}",
           f"in the process set of ranks {members}")
    # broadcast roots are the job's ranks in the message too (the set's engine agrees on positions)
    raises(aiacc.TensorMismatchError, lambda: aiacc.broadcast(np.ones(2), r, name="own_root", process_set=mine),
           "root rank differs across ranks", f"rank {members[0]}: {members[0]};", f"rank {members[1]}: {members[1]})")
    checks += 3
# Horovod's optimizers skip the reduction on a rank outside their set; an unregistered set is an error instead
assert aiacc.outside_process_set(other) and not aiacc.outside_process_set(mine)
assert not aiacc.outside_process_set(aiacc.global_process_set) and not aiacc.outside_process_set(None)
assert not aiacc.outside_process_set(aiacc.ProcessSet([k for k in range(n) if k != r]))
checks += 1
# an operation still pending on a set when it is removed: the error names the set, its removal and this rank
lonely = aiacc.allreduce_async(np.ones(2), name="lonely", process_set=even) if n > 2 and r == 2 else None
ids = (odd.process_set_id, even.process_set_id)
assert aiacc.remove_process_set(odd) and aiacc.remove_process_set(even)
if lonely is not None:
    raises(aiacc.ShutdownError, lambda: aiacc.synchronize(lonely), "allreduce of tensor 'lonely' on rank 2 did not "
           f"complete: process set {ids[1]} (ranks [0, 2]) was removed (remove_process_set)")
    checks += 1
assert odd.process_set_id is None and not aiacc.remove_process_set(aiacc.global_process_set)
again = aiacc.add_process_set(even.ranks)  # a removed set's ranks can form a set again
assert again.process_set_id == ids[0], (again, ids)  # with the id freed first (Horovod's)
# a list of ranks is not the set (it returned False and left the set registered: the next add was a duplicate)
raises(TypeError, lambda: aiacc.remove_process_set(list(again.ranks)), "remove_process_set takes the ProcessSet "
       f"that add_process_set returned (or that was passed to init), got list {list(again.ranks)}")
raises(TypeError, lambda: aiacc.remove_process_set(None), "got NoneType None")
checks += 1
if again.included():
    check("after remove", aiacc.allreduce(np.ones(3), op=aiacc.Sum, name="x", process_set=again),
          np.full(3, float(len(again.ranks))))
aiacc.barrier()
aiacc.shutdown()
# the global set after shutdown(): it answered rank() 0 on every rank (`if global_process_set.rank() == 0: save()`)
raises(aiacc.NotInitializedError, lambda: aiacc.global_process_set.rank(),
       "aiacc.global_process_set.rank() was called after aiacc.shutdown()")
raises(aiacc.NotInitializedError, lambda: aiacc.global_process_set.included(), "global_process_set.included()")
checks += 1
say(f"OK rank={r} checks={checks}")
sys.exit(0)
