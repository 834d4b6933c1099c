"""Gluon training patterns of real scripts under DistributedTrainer, each against gluon.Trainer in one process on
the whole batch (every rank computes that reference itself), with a guard that the parameters moved:

1. Gradient clipping the Gluon way: ``allreduce_grads()``, ``clip_global_norm`` over ``p.grad()``, ``update(b)``.
   The clip sees what one process sees: with per-sample losses and the per-rank batch size, the sum over the ranks
   (Horovod's DistributedTrainer sums too). Before, it saw the average, 1/size of it, so every clipped step moved
   the parameters by a different amount than one process (and than Horovod). A mean loss stepped with
   ``update(1)`` clips at ``max_norm * size`` (gluon-nlp's Horovod scripts do), and a clip that changes nothing
   shows that ``update()`` does not reduce again.
2. ``step(b, ignore_stale_grad=True)`` with a branch that some steps skip, ``set_learning_rate`` mid-training and
   ``learning_rate``.
3. ``multi_precision=True`` over a float16 model (SGD, SGD with momentum, Adam): the float32 master weights and
   states equal one process bit for bit (inputs whose float16 sums are exact).
4. ``save_states`` on rank 0, ``load_states`` on every rank into a new DistributedTrainer, training on.
5. A block hybridized with ``static_alloc``/``static_shape``, ``grad_req='add'``, two forward/backward passes per
   step, ``step(2 * b)`` and ``p.zero_grad()``.
6. ``grad_req='add'`` never zeroed between steps (the sum a step left was summed again in the next)."""

import os
import sys

import numpy as np

import aiacc.mxnet as hvd
import mxnet as mx
from mxnet import autograd, gluon, nd

from report import say

hvd.init()
r, n = hvd.rank(), hvd.size()
B, F, C = 12, 6, 3  # 12 rows split evenly over 2 or 3 ranks
b = B // n
mine = slice(r * b, (r + 1) * b)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
checks = 0


def mlp(prefix):
    mx.random.seed(5)
    net = gluon.nn.HybridSequential(prefix=prefix)
    with net.name_scope():
        net.add(gluon.nn.Dense(8, activation="tanh", in_units=F), gluon.nn.Dense(C, in_units=8))
    net.initialize(mx.init.Xavier())
    return net


def batch(step):
    rng = np.random.default_rng(100 + step)
    return (nd.array(rng.standard_normal((B, F)).astype(np.float32) * 3),
            nd.array(rng.integers(0, C, B).astype(np.float32)))


def same(what, dist, ref, start, tol=1e-5):
    """dist's parameters equal ref's (in order), and moved from ``start``."""
    global checks
    for p, q, s in zip(dist.collect_params().values(), ref.collect_params().values(), start):
        got, want = p.data().asnumpy(), q.data().asnumpy()
        assert np.allclose(got, want, rtol=tol, atol=tol), \
            f"{what}: {p.name} differs from one process by {np.abs(got - want).max()}"
        assert not np.allclose(got, s), f"{what}: {p.name} did not move"
    checks += 1


def snapshot(net):
    return [p.data().asnumpy().copy() for p in net.collect_params().values()]


# ---- 1. clipping between allreduce_grads() and update() ---------------------------------------------------
def clipping(case, max_norm, mean):
    dist, ref = mlp(f"clip{case}d_"), mlp(f"clip{case}r_")
    start = snapshot(dist)
    td = hvd.DistributedTrainer(dist.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.5},
                                prefix=f"clip{case}.")
    tr = gluon.Trainer(ref.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.5}, kvstore=None)
    clipped = 0
    for step in range(5):
        x, y = batch(step)
        # a mean loss stepped with 1 (gluon-nlp's style): the clip takes max_norm * size, as under Horovod
        for net, trainer, rows, norm in ((dist, td, mine, max_norm * n if mean else max_norm),
                                         (ref, tr, slice(None), max_norm)):
            with autograd.record():
                loss = loss_fn(net(x[rows]), y[rows])
                if mean:
                    loss = loss.mean()
            loss.backward()
            trainer.allreduce_grads()
            total = gluon.utils.clip_global_norm([p.grad() for p in net.collect_params().values()], norm)
            clipped += trainer is tr and total > norm
            trainer.update(1 if mean else x[rows].shape[0])
    assert clipped == (5 if max_norm < 1 else 0), f"clipping {case}: the reference clipped {clipped} of 5 steps"
    same(f"clipping {case}", dist, ref, start)


clipping("sum", 0.5, mean=False)
clipping("mean", 0.05, mean=True)
clipping("none", 1e6, mean=False)  # clips nothing: update() applies the one reduction


# ---- 2. stale gradients skipped, learning rate changed -----------------------------------------------------
class Branch(gluon.Block):
    def __init__(self, prefix):
        super().__init__(prefix=prefix)
        with self.name_scope():
            self.a = gluon.nn.Dense(C, in_units=F)
            self.b = gluon.nn.Dense(C, in_units=F)

    def forward(self, x, use_b):
        y = self.a(x)
        return y + self.b(x) if use_b else y


def branch(prefix):
    mx.random.seed(5)
    net = Branch(prefix)
    net.initialize(mx.init.Xavier())
    return net


dist, ref = branch("stale_d_"), branch("stale_r_")
start = snapshot(dist)
opt = {"learning_rate": 0.1, "momentum": 0.9}
td = hvd.DistributedTrainer(dist.collect_params(), "sgd", dict(opt), prefix="stale.")
tr = gluon.Trainer(ref.collect_params(), "sgd", dict(opt), kvstore=None)
for step in range(8):
    if step == 3:
        td.set_learning_rate(0.03)
        tr.set_learning_rate(0.03)
    assert td.learning_rate == tr.learning_rate, (step, td.learning_rate, tr.learning_rate)
    x, y = batch(step)
    for net, trainer, rows in ((dist, td, mine), (ref, tr, slice(None))):
        with autograd.record():
            loss = loss_fn(net(x[rows], step % 3 == 0), y[rows])
        loss.backward()
        trainer.step(x[rows].shape[0], ignore_stale_grad=True)
same("ignore_stale_grad and set_learning_rate", dist, ref, start)


# ---- 3. multi_precision over float16 -----------------------------------------------------------------------
class Linear16(gluon.HybridBlock):
    """(MXNet's CPU build has no float16 FullyConnected: elementwise operators instead.)"""

    def __init__(self, prefix):
        super().__init__(prefix=prefix)
        with self.name_scope():
            self.w = self.params.get("w", shape=(1, F), init=mx.init.Uniform(0.5))
            self.b = self.params.get("b", shape=(1,), init=mx.init.Zero())

    def hybrid_forward(self, fn, x, w, b):
        return fn.broadcast_add(fn.sum(fn.broadcast_mul(x, w), axis=1, keepdims=True), b)


def states(trainer):
    out = []
    for k in sorted(trainer._updaters[0].states):
        state = trainer._updaters[0].states[k]
        for a in (state if isinstance(state, (tuple, list)) else (state,)):
            for s in (a if isinstance(a, (tuple, list)) else (a,)):
                if s is not None:
                    out.append(s)
    return out


for name, extra in (("sgd", {}), ("sgd", {"momentum": 0.9}), ("adam", {})):
    nets = []
    for prefix in ("mp_d_", "mp_r_"):
        mx.random.seed(5)
        net = Linear16(prefix)
        net.initialize()
        net.cast("float16")
        nets.append(net)
    dist, ref = nets
    start = snapshot(dist)
    opt = {"learning_rate": 0.01, "multi_precision": True, **extra}
    td = hvd.DistributedTrainer(dist.collect_params(), name, dict(opt), prefix=f"mp.{name}{len(extra)}.")
    tr = gluon.Trainer(ref.collect_params(), name, dict(opt), kvstore=None)
    for step in range(6):
        x = nd.array(np.random.default_rng(step).integers(-4, 5, (B, F)), dtype="float16")
        for net, trainer, rows in ((dist, td, mine), (ref, tr, slice(None))):
            with autograd.record():
                loss = net(x[rows])  # linear: the float16 gradients are exact sums of small integers
            loss.backward()
            trainer.step(x[rows].shape[0])
    got, want = states(td), states(tr)
    assert len(got) == len(want) >= 2, (name, len(got), len(want))
    assert any(s.dtype == np.float32 for s in got), f"multi_precision {name}: no float32 master weights"
    for s, t in zip(got, want):
        assert s.dtype == t.dtype and np.array_equal(s.asnumpy(), t.asnumpy()), \
            f"multi_precision {name} {extra}: state {s.asnumpy()} != one process {t.asnumpy()}"
    same(f"multi_precision {name} {extra}", dist, ref, start, tol=0)


# ---- 4. save_states / load_states --------------------------------------------------------------------------
folder = sys.argv[1]
dist, ref = mlp("ckpt_d_"), mlp("ckpt_r_")
start = snapshot(dist)
opt = {"learning_rate": 0.05, "momentum": 0.9}
td = hvd.DistributedTrainer(dist.collect_params(), "sgd", dict(opt), prefix="ckpt.")
tr = gluon.Trainer(ref.collect_params(), "sgd", dict(opt), kvstore=None)
for step in range(8):
    if step == 4:
        if r == 0:
            td.save_states(os.path.join(folder, "dist.states"))
        hvd.allreduce(nd.zeros(1), name="ckpt.saved")  # written before any rank reads it
        td = hvd.DistributedTrainer(dist.collect_params(), "sgd", dict(opt), prefix="ckpt.loaded.")
        td.load_states(os.path.join(folder, "dist.states"))
        tr.save_states(os.path.join(folder, f"ref{r}.states"))
        tr = gluon.Trainer(ref.collect_params(), "sgd", dict(opt), kvstore=None)
        tr.load_states(os.path.join(folder, f"ref{r}.states"))
    x, y = batch(step)
    for net, trainer, rows in ((dist, td, mine), (ref, tr, slice(None))):
        with autograd.record():
            loss = loss_fn(net(x[rows]), y[rows])
        loss.backward()
        trainer.step(x[rows].shape[0])
same("save_states / load_states", dist, ref, start)


# ---- 5. static hybridized, grad_req='add', two passes per step, p.zero_grad() ------------------------------
dist, ref = mlp("add_d_"), mlp("add_r_")
start = snapshot(dist)
for net in (dist, ref):
    net.hybridize(static_alloc=True, static_shape=True)
    for p in net.collect_params().values():
        p.grad_req = "add"
td = hvd.DistributedTrainer(dist.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9}, prefix="add.")
tr = gluon.Trainer(ref.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9}, kvstore=None)
for step in range(5):
    for net, trainer, rows in ((dist, td, mine), (ref, tr, slice(None))):
        for k in range(2):
            x, y = batch(step + 50 * k)
            with autograd.record():
                loss = loss_fn(net(x[rows]), y[rows])
            loss.backward()
        trainer.step(2 * x[rows].shape[0])
        for p in net.collect_params().values():
            p.zero_grad()
same("static hybridized grad_req='add'", dist, ref, start)

# grad_req='add' never zeroed: every step adds to what the last one left, in one process the whole batch's sum. The
# sum over the ranks left in p.grad() was summed again (size times) in the next step; update() leaves the average
dist, ref = mlp("keep_d_"), mlp("keep_r_")
start = snapshot(dist)
for net in (dist, ref):
    for p in net.collect_params().values():
        p.grad_req = "add"
td = hvd.DistributedTrainer(dist.collect_params(), "sgd", {"learning_rate": 0.1}, prefix="keep.")
tr = gluon.Trainer(ref.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=None)
for step in range(4):
    x, y = batch(step)
    for net, trainer, rows in ((dist, td, mine), (ref, tr, slice(None))):
        with autograd.record():
            loss = loss_fn(net(x[rows]), y[rows])
        loss.backward()
        if step % 2:
            trainer.step(x[rows].shape[0])
        else:
            trainer.allreduce_grads()
            trainer.update(x[rows].shape[0])
same("grad_req='add' not zeroed between steps", dist, ref, start)

say(f"OK rank={r} checks={checks}")
