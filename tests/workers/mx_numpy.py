"""MXNet's numpy semantics (``npx.set_np()``, what d2l and GluonNLP use): DistributedTrainer trains as one process
on the whole batch, and every ``Parameter.grad()`` stays an ``mx.np.ndarray``, as gluon's, also once the
gradients live in the buckets (before: a legacy NDArray from the first step on, so ``np.linalg.norm(p.grad())`` or
``p.grad() * p.data()`` raised MXNet's TypeError about legacy ndarrays). The collectives answer an
``mx.np.ndarray`` with ``mx.np.ndarray`` results (before: legacy NDArrays, refused by the numpy operators)."""

import numpy as onp

import aiacc.mxnet as hvd
import mxnet as mx
from mxnet import autograd, gluon, np, npx

from report import say

npx.set_np()
hvd.init()
r, n = hvd.rank(), hvd.size()
ROWS = 4
rng = onp.random.default_rng(3)
X = rng.standard_normal((5, n * ROWS, 5)).astype(onp.float32)
Y = rng.standard_normal((5, n * ROWS, 3)).astype(onp.float32)
checks = 0


def model(prefix):
    net = gluon.nn.HybridSequential(prefix=prefix)
    with net.name_scope():
        net.add(gluon.nn.Dense(4, in_units=5, activation="tanh"), gluon.nn.Dense(3, in_units=4))
    mx.random.seed(3)
    net.initialize(mx.init.Xavier())
    return net


dist, ref = model("dist_"), model("ref_")
hvd.broadcast_parameters(dist.collect_params())
trainer = hvd.DistributedTrainer(dist.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9})
ref_trainer = gluon.Trainer(ref.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9}, kvstore=None)
mine = slice(r * ROWS, (r + 1) * ROWS)
for step in range(len(X)):
    for net, tr, x, y, batch in ((dist, trainer, X[step, mine], Y[step, mine], ROWS),
                                 (ref, ref_trainer, X[step], Y[step], n * ROWS)):
        with autograd.record():
            loss = ((net(np.array(x)) - np.array(y)) ** 2).sum()
        loss.backward()
        tr.step(batch)
    for p, q in zip(dist.collect_params().values(), ref.collect_params().values()):
        assert type(p.grad()) is type(q.grad()) is np.ndarray, f"step {step}: {p.name}.grad() is a {type(p.grad())}"
        norm = float(np.linalg.norm(p.grad() * p.data()))  # numpy operators take it
        assert onp.isfinite(norm)
        assert onp.allclose(p.data().asnumpy(), q.data().asnumpy(), rtol=1e-5, atol=1e-6), f"step {step}: {p.name}"
        checks += 1

# ---- the collectives: results of the input's kind, with the right values -------------------------------------
x = np.array(onp.arange(6, dtype=onp.float32).reshape(3, 2) + r)
mine = onp.arange(6, dtype=onp.float32).reshape(3, 2)
rows = onp.concatenate([mine + k for k in range(n)])
total = sum(mine + k for k in range(n))
splits = [1] * (n - 1) + [3 - (n - 1)]
results = {
    "allreduce": (hvd.allreduce(x, op=hvd.Sum, name="np.ar"), total),
    "allreduce_": (hvd.allreduce_(x.copy(), op=hvd.Sum, name="np.ar_"), total),
    "grouped_allreduce": (hvd.grouped_allreduce([x], op=hvd.Sum, name="np.gar")[0], total),
    "allgather": (hvd.allgather(x, name="np.ag"), rows),
    "grouped_allgather": (hvd.grouped_allgather([x], name="np.gag")[0], rows),
    "broadcast": (hvd.broadcast(x, 0, name="np.bc"), mine),
    "broadcast_": (hvd.broadcast_(x.copy(), 0, name="np.bc_"), mine),
    "reducescatter": (hvd.reducescatter(np.array(onp.ones((n, 2), onp.float32)), op=hvd.Sum, name="np.rs"),
                      onp.full((1, 2), n)),
    "grouped_reducescatter": (hvd.grouped_reducescatter([np.array(onp.ones((n, 2), onp.float32))], op=hvd.Sum,
                                                        name="np.grs")[0], onp.full((1, 2), n)),
    "alltoall": (hvd.alltoall(np.array(onp.full((n, 2), r, onp.float32)), name="np.a2a"),
                 onp.repeat(onp.arange(n, dtype=onp.float32), 2).reshape(n, 2)),
}
got, received = hvd.alltoall(x, splits=splits, name="np.a2a_splits")
results["alltoall received_splits"] = (received, onp.full(n, splits[r]))
for what, (got, want) in results.items():
    assert isinstance(got, np.ndarray), f"{what} of an mx.np.ndarray returned a {type(got)}"
    assert onp.array_equal(got.asnumpy(), want), f"{what}: {got.asnumpy()} != {want}"
    assert float((got * got).sum()) >= 0  # numpy operators take it
    checks += 1
hvd.barrier()
say(f"OK rank={r} checks={checks}")
