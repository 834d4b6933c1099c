"""aiacc.mxnet's process sets: every NDArray collective, DistributedOptimizer and DistributedTrainer
among a subset of the ranks, against numpy references computed on every rank.

Run with 3 ranks: the even ranks [0, 2] and the odd ranks [1] each run their own engine. Inputs are
deterministic functions of (rank, seed), so each rank computes what every member of its set
contributed. Roots are ranks of the job; results follow the order of the set's ranks. A rank
outside the set of a DistributedOptimizer / DistributedTrainer updates with its own gradients (as
in Horovod). Misuse (a set this rank is not in, a root outside the set, a set that was removed) is
an error naming the set.
"""

import numpy as np

import aiacc.mxnet as hvd
import mxnet as mx
from mxnet import autograd, gluon, nd

from report import assert_matches, raises, say

hvd.init()
r, n = hvd.rank(), hvd.size()
checks = 0
even = hvd.add_process_set([k for k in range(n) if k % 2 == 0])
odd = hvd.add_process_set(hvd.ProcessSet([k for k in range(n) if k % 2 == 1]))
mine, other = (even, odd) if r % 2 == 0 else (odd, even)
members = mine.ranks
m, i = len(members), members.index(r)
assert mine.included() and not other.included() and mine.rank() == i and mine.size() == m
assert hvd.global_process_set.ranks == list(range(n)) and hvd.global_process_set.process_set_id == 0


def data(rank, dtype, shape, seed):
    rng = np.random.default_rng(seed * 1000 + rank)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-20, 20, size=shape).astype(dtype)
    return (rng.random(shape) * 4 - 2).astype(dtype)


def check(what, got, want, dtype):
    global checks
    assert isinstance(got, nd.NDArray), f"{what}: returned {type(got).__name__}, not an NDArray"
    assert_matches(what, got.asnumpy(), want, dtype, {"float16": 4e-3, "float32": 1e-5, "float64": 1e-12})
    checks += 1


# ---- every collective among the set's ranks --------------------------------------------------------
for seed, dtype in enumerate(["float16", "float32", "float64", "int32", "int64"]):
    shape = (3, 4)
    ins = {k: data(k, dtype, shape, seed) for k in members}
    as64 = np.stack([ins[k].astype(np.float64) for k in members])
    total = as64.sum(0)
    mine_nd = nd.array(ins[r], dtype=dtype)
    # the same names in both sets: each set has its own engine and its own names
    check(f"allreduce Sum {dtype}", hvd.allreduce(mine_nd, op=hvd.Sum, name=f"s.{dtype}", process_set=mine),
          total, dtype)
    avg = np.trunc(total / m) if np.dtype(dtype).kind in "iu" else total / m
    check(f"allreduce Average {dtype}", hvd.allreduce(mine_nd, name=f"a.{dtype}", process_set=mine), avg, dtype)
    check(f"allreduce Max {dtype}", hvd.allreduce(mine_nd, op=hvd.Max, name=f"mx.{dtype}", process_set=mine),
          as64.max(0), dtype)
    inplace = nd.array(ins[r], dtype=dtype)
    assert hvd.allreduce_(inplace, op=hvd.Sum, name=f"i.{dtype}", process_set=mine) is inplace
    check(f"allreduce_ {dtype}", inplace, total, dtype)
    pair = [mine_nd, nd.array(ins[r][0], dtype=dtype)]
    got = hvd.grouped_allreduce(pair, op=hvd.Sum, name=f"g.{dtype}", process_set=mine)
    check(f"grouped_allreduce {dtype}", got[1], total[0], dtype)
    assert hvd.grouped_allreduce_(pair, op=hvd.Sum, name=f"g_.{dtype}", process_set=mine) == pair
    check(f"grouped_allreduce_ {dtype}", pair[0], total, dtype)
    assert np.array_equal(mine_nd.asnumpy(), total.astype(dtype)), "grouped_allreduce_ did not write in place"
    # allgather: a different first dimension on every rank, in the order of the set's ranks
    rows = {k: data(k, dtype, (k + 1, 2), seed + 50) for k in members}
    check(f"allgather {dtype}", hvd.allgather(nd.array(rows[r], dtype=dtype), name=f"ag.{dtype}", process_set=mine),
          np.concatenate([rows[k] for k in members]), dtype)
    got = hvd.grouped_allgather([nd.array(rows[r], dtype=dtype), nd.array(ins[r], dtype=dtype)],
                                name=f"gag.{dtype}", process_set=mine)
    check(f"grouped_allgather[0] {dtype}", got[0], np.concatenate([rows[k] for k in members]), dtype)
    check(f"grouped_allgather[1] {dtype}", got[1], np.concatenate([ins[k] for k in members]), dtype)
    # broadcast: the root is a rank of the job
    root = members[-1]
    check(f"broadcast {dtype}", hvd.broadcast(nd.array(ins[r], dtype=dtype), root_rank=root, name=f"b.{dtype}",
                                              process_set=mine), ins[root], dtype)
    target = nd.array(ins[r], dtype=dtype)
    assert hvd.broadcast_(target, root, name=f"b_.{dtype}", process_set=mine) is target
    check(f"broadcast_ {dtype}", target, ins[root], dtype)
    # alltoall: the member at position p sends p + q + 1 rows to the member at position q
    splits = [i + q + 1 for q in range(m)]
    send = np.concatenate([np.full((s, 2), 10 * r + q, dtype) for q, s in enumerate(splits)])
    got, received = hvd.alltoall(nd.array(send, dtype=dtype), splits=nd.array(splits, dtype="int32"),
                                 name=f"a2a.{dtype}", process_set=mine)
    check(f"alltoall {dtype}", got,
          np.concatenate([np.full((p + i + 1, 2), 10 * k + i, dtype) for p, k in enumerate(members)]), dtype)
    check(f"alltoall received_splits {dtype}", received, np.array([p + i + 1 for p in range(m)]), "int32")
    equal = np.arange(2 * m * 3).reshape(2 * m, 3).astype(dtype)
    got = hvd.alltoall(nd.array(equal, dtype=dtype), name=f"a2a.eq.{dtype}", process_set=mine)
    check(f"alltoall equal {dtype}", got, np.concatenate([equal[2 * i:2 * i + 2]] * m), dtype)
    # reducescatter: the member at position p keeps block p
    blocks = {k: data(k, dtype, (2 * m, 3), seed + 70) for k in members}
    summed = np.sum([blocks[k].astype(np.float64) for k in members], 0)
    check(f"reducescatter {dtype}", hvd.reducescatter(nd.array(blocks[r], dtype=dtype), op=hvd.Sum,
                                                      name=f"rs.{dtype}", process_set=mine),
          summed[2 * i:2 * i + 2], dtype)
    got = hvd.grouped_reducescatter([nd.array(blocks[r], dtype=dtype), nd.array(ins[r], dtype=dtype)],
                                    op=hvd.Sum, name=f"grs.{dtype}", process_set=mine)
    check(f"grouped_reducescatter[0] {dtype}", got[0], summed[2 * i:2 * i + 2], dtype)
    lo = sum(3 // m + (p < 3 % m) for p in range(i))  # 3 rows over m ranks: the first 3 % m get one more
    check(f"grouped_reducescatter[1] {dtype}", got[1], total[lo:lo + 3 // m + (i < 3 % m)], dtype)
    if np.dtype(dtype).kind == "f":
        got = hvd.reducescatter(nd.array(blocks[r], dtype=dtype), op=hvd.Average, name=f"rs.scaled.{dtype}",
                                process_set=mine, prescale_factor=0.5, postscale_factor=3.0)
        check(f"reducescatter scaled {dtype}", got, summed[2 * i:2 * i + 2] * 1.5 / m, dtype)
hvd.barrier(process_set=mine)
say(f"SET_COLLECTIVES_OK rank={r} set={mine.process_set_id} checks={checks}")

# ---- DistributedOptimizer on the even ranks: the odd ones update with their own gradients -----------
shape = (4, 5)
w0 = data(0, "float32", shape, 300)
grads = {k: data(k, "float32", shape, 301) for k in range(n)}
opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.5), process_set=even)
assert isinstance(opt, hvd.DistributedOptimizer)
w, g = nd.array(w0), nd.array(grads[r])
opt.update(0, w, g, opt.create_state(0, w))
used = np.mean([grads[k] for k in even.ranks], 0) if even.included() else grads[r]
check("DistributedOptimizer on a set", w, w0 - 0.5 * used, "float32")
check("DistributedOptimizer's gradient", g, used, "float32")
say(f"OPTIMIZER_OK rank={r} member={even.included()}")

# ---- DistributedTrainer on the even ranks, against a reference on every rank -----------------------
STEPS, BATCH, FEAT = 4, 6, 5
X = {k: np.random.default_rng(400 + k).standard_normal((STEPS, BATCH, FEAT)).astype(np.float32) for k in range(n)}
Y = {k: np.random.default_rng(500 + k).standard_normal((STEPS, BATCH, 2)).astype(np.float32) for k in range(n)}
loss_fn = gluon.loss.L2Loss()


def dense(prefix):
    net = gluon.nn.Dense(2, in_units=FEAT, prefix=prefix)
    net.initialize(mx.init.Constant(0.1))
    return net


net = dense("set_")
initial = [p.data().asnumpy() for p in net.collect_params().values()]
trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.2}, process_set=even)
ref = dense("ref_")
ref_params = list(ref.collect_params().values())
contributors = even.ranks if even.included() else [r]
for step in range(STEPS):
    with autograd.record():
        loss = loss_fn(net(nd.array(X[r][step])), nd.array(Y[r][step]))
    loss.backward()
    trainer.step(BATCH)
    # reference: plain SGD with the mean of the contributors' gradients (each computed here)
    summed = [np.zeros(p.shape, np.float32) for p in ref_params]
    for k in contributors:
        with autograd.record():
            loss = loss_fn(ref(nd.array(X[k][step])), nd.array(Y[k][step]))
        loss.backward()
        for acc, p in zip(summed, ref_params):
            acc += p.grad().asnumpy()
    for acc, p in zip(summed, ref_params):
        p.set_data(p.data() - 0.2 / BATCH * nd.array(acc / len(contributors)))
for p, q, before in zip(net.collect_params().values(), ref_params, initial):
    check(f"DistributedTrainer {p.name}", p.data(), q.data().asnumpy(), "float32")
    assert np.abs(p.data().asnumpy() - before).max() > 1e-3, f"{p.name} did not train"
say(f"TRAINER_OK rank={r} member={even.included()}")

# ---- misuse ----------------------------------------------------------------------------------------
errors = {  # what the user does wrong -> words the message must contain
    "not a member": (lambda: hvd.allreduce(nd.ones(2), name="x", process_set=other),
                     f"rank {r} is not in process set {other.process_set_id}"),
    "root outside": (lambda: hvd.broadcast(nd.ones(2), root_rank=other.ranks[0], process_set=mine),
                     f"root_rank={other.ranks[0]} is not in process set {mine.process_set_id}"),
    "unregistered": (lambda: hvd.allgather(nd.ones(2), process_set=hvd.ProcessSet([0])),
                     "not a registered process set"),
    "optimizer set": (lambda: hvd.DistributedOptimizer(mx.optimizer.SGD(), process_set=hvd.ProcessSet([0])),
                      "not a registered process set"),
}
for what, (call, words) in errors.items():
    say(f"SET_ERROR_OK rank={r} {what}: {raises(ValueError, call, words)}")
assert hvd.remove_process_set(odd) and hvd.remove_process_set(even)
assert not hvd.remove_process_set(hvd.global_process_set)
text = raises(ValueError, lambda: hvd.allreduce(nd.ones(2), process_set=mine), "not a registered process set")
say(f"SET_ERROR_OK rank={r} removed: {text}")
hvd.barrier()
say(f"OK rank={r} checks={checks}")
hvd.shutdown()
