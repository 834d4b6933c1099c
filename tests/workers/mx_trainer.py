"""Gluon training on 2 or more ranks against a 1-process reference, computed on every rank.

1. ``broadcast_parameters`` makes differently initialised ranks equal (also for
   parameters whose initialisation is deferred to the first forward pass).
2. ``DistributedTrainer`` (SGD with momentum, Adam, a hybridized convnet (also with static_alloc and static_shape),
   SGD with gradient_predivide_factor, fp16 compression, and gradients MXNet replaces
   mid-training: ``grad_req`` switched to 'add' with two backward passes per step and
   ``zero_grad()``, then a frozen layer): each rank trains on its share of every batch;
   every rank also trains a reference model on the whole batch with a plain
   ``gluon.Trainer``; after 20 steps the parameters must agree.
3. A deep model whose backward pauses near the input runs a few steps with the timeline
   on (the test reads it).
4. Misuse: a parameter with a different shape on each rank is an error naming it.
5. A backward pass that fails inside MXNet makes ``step()`` raise MXNet's error (no hang).
"""


import time

import numpy as np

import aiacc.mxnet as hvd
import mxnet as mx
from mxnet import autograd, gluon, nd

from report import raises, say

hvd.init()
r, n = hvd.rank(), hvd.size()
STEPS, GLOBAL_BATCH, FEATURES, CLASSES = 20, 24, 20, 5  # 24 rows split evenly over 2, 3 or 4 ranks
assert GLOBAL_BATCH % n == 0


def params_of(net):
    return {k: p.data().asnumpy() for k, p in net.collect_params().items()}


def gathered_equal(arr, name):
    """True if ``arr`` (an NDArray) is the same on every rank."""
    rows = hvd.allgather(arr.reshape((1, -1)), name=f"check.{name}").asnumpy()
    return all(np.array_equal(rows[0], row) for row in rows[1:])


def mlp(prefix):
    net = gluon.nn.Sequential(prefix=prefix)
    with net.name_scope():
        net.add(gluon.nn.Dense(32, activation="relu", in_units=FEATURES),
                gluon.nn.Dense(16, activation="tanh", in_units=32),
                gluon.nn.Dense(CLASSES, in_units=16))
    return net


def convnet(prefix):
    """Convolution (oneDNN kernels in this MXNet build), hybridized: (B, 20) seen as (B, 1, 4, 5)."""
    net = gluon.nn.HybridSequential(prefix=prefix)
    with net.name_scope():
        net.add(gluon.nn.HybridLambda(lambda F, x: F.reshape(x, shape=(0, 1, 4, 5))),
                gluon.nn.Conv2D(4, 3, padding=1, activation="relu", in_channels=1),
                gluon.nn.Flatten(),
                gluon.nn.Dense(CLASSES, in_units=80))
    net.hybridize()
    return net


def convnet_static(prefix):
    """The convnet hybridized with static memory and shapes: its CachedOp keeps writing the gradient
    arrays it bound in its first backward (they used to be read never again: step 1's gradients forever)."""
    net = convnet(prefix)
    net.hybridize(static_alloc=True, static_shape=True)
    return net


# ---- 1. broadcast_parameters ------------------------------------------------------------------
mx.random.seed(100 + r)  # a different initialisation on every rank
net = mlp("bcast_")
net.initialize(mx.init.Xavier())
before = params_of(net)
differs = not all(gathered_equal(p.data(), f"pre.{k}") for k, p in net.collect_params().items())
assert differs, "the ranks' initial parameters should differ before broadcast_parameters"
hvd.broadcast_parameters(net.collect_params(), root_rank=1)
for k, p in net.collect_params().items():
    assert gathered_equal(p.data(), k), f"{k} differs across ranks after broadcast_parameters"
    if r == 1:
        assert np.array_equal(p.data().asnumpy(), before[k]), f"root's {k} changed"
# a plain dict of NDArrays, as Module.get_params() returns
arrays = {"w": nd.array(np.full((3, 4), float(r + 1), np.float32)), "b": nd.array(np.arange(5) * (r + 1))}
hvd.broadcast_parameters(arrays, root_rank=0)
assert np.array_equal(arrays["w"].asnumpy(), np.ones((3, 4))) and np.array_equal(arrays["b"].asnumpy(), np.arange(5))
# deferred initialisation: shapes known only after the first forward pass
deferred = gluon.nn.Dense(7, prefix="deferred_")
deferred.initialize(mx.init.Normal(1.0 + r))
hvd.broadcast_parameters(deferred.collect_params(), root_rank=0)
deferred(nd.ones((2, 6)))
assert deferred.weight.shape == (7, 6)
assert gathered_equal(deferred.weight.data(), "deferred.weight"), "deferred parameter not broadcast after init"
say(f"BROADCAST_OK rank={r}")

# ---- 2. DistributedTrainer vs a single process on the whole batch -----------------------------
rng = np.random.default_rng(7)  # the same data on every rank
X = rng.standard_normal((STEPS, GLOBAL_BATCH, FEATURES)).astype(np.float32)
Y = rng.integers(0, CLASSES, size=(STEPS, GLOBAL_BATCH)).astype(np.float32)
local = GLOBAL_BATCH // n
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()


def accumulate_then_freeze(step, net):
    """From step 8 gradients accumulate over two backward passes (a change of grad_req makes MXNet
    replace every gradient array); from step 14 the first layer is frozen (fewer gradients)."""
    params = list(net.collect_params().values())
    if step == 8:
        for p in params:
            p.grad_req = "add"
    if step == 14:
        params[0].grad_req = params[1].grad_req = "null"
    return 2 if step >= 8 else 1


# Adam runs in float64: in float32 the rounding of a half-batch sum vs a whole-batch sum alone
# already reaches ~8e-6 relative after 20 Adam steps (m / sqrt(v) amplifies it), too close to 1e-5.
CASES = [
    (mlp, "sgd", {"learning_rate": 0.1, "momentum": 0.9}, {}, "float32", 1e-5, None),
    (mlp, "adam", {"learning_rate": 0.01}, {}, "float64", 1e-5, None),
    (convnet, "sgd", {"learning_rate": 0.1, "momentum": 0.9}, {}, "float32", 1e-5, None),
    (convnet_static, "sgd", {"learning_rate": 0.1, "momentum": 0.9}, {}, "float32", 1e-5, None),
    (mlp, "sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3}, {"gradient_predivide_factor": 2.0}, "float32",
     1e-5, None),
    (mlp, "sgd", {"learning_rate": 0.1, "momentum": 0.9}, {"compression": hvd.Compression.fp16}, "float32", 2e-2,
     None),
    (mlp, "sgd", {"learning_rate": 0.05, "momentum": 0.9}, {}, "float32", 1e-5, accumulate_then_freeze),
]
for case, (model, opt, opt_params, extra, dtype, tol, schedule) in enumerate(CASES):
    mx.random.seed(case * 10 + r)
    dist = model(f"case{case}_")
    dist.initialize(mx.init.Xavier())
    dist.cast(dtype)
    hvd.broadcast_parameters(dist.collect_params(), root_rank=0)
    ref = model(f"ref{case}_")
    ref.initialize()
    ref.cast(dtype)
    for (k, p), q in zip(dist.collect_params().items(), ref.collect_params().values()):
        q.set_data(p.data().copy())
    initial = params_of(dist)
    trainer = hvd.DistributedTrainer(dist.collect_params(), opt, dict(opt_params), **extra)
    ref_trainer = gluon.Trainer(ref.collect_params(), opt, dict(opt_params), kvstore=None)
    for step in range(STEPS):
        passes = 1
        if schedule is not None:
            passes = schedule(step, dist)
            schedule(step, ref)
        xs, ys = X[step, r * local:(r + 1) * local], Y[step, r * local:(r + 1) * local]
        for _ in range(passes):
            with autograd.record():
                loss = loss_fn(dist(nd.array(xs, dtype=dtype)), nd.array(ys, dtype=dtype))
            loss.backward()
            with autograd.record():
                ref_loss = loss_fn(ref(nd.array(X[step], dtype=dtype)), nd.array(Y[step], dtype=dtype))
            ref_loss.backward()
        trainer.step(local)
        ref_trainer.step(GLOBAL_BATCH)
        if passes > 1:
            dist.collect_params().zero_grad()
            ref.collect_params().zero_grad()
    worst = 0.0
    for (k, p), q in zip(dist.collect_params().items(), ref.collect_params().values()):
        a, b = p.data().asnumpy(), q.data().asnumpy()
        rel = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
        worst = max(worst, rel)
        assert rel <= tol, f"case {case} ({opt} {extra}): {k} differs from the reference by {rel:.2e} (tol {tol})"
        assert gathered_equal(p.data(), f"final.{case}.{k}"), f"case {case}: {k} differs across ranks"
    moved = max(float(np.abs(p.data().asnumpy() - initial[k]).max()) for k, p in dist.collect_params().items())
    assert moved > 1e-3, f"case {case}: training did not change the parameters"
    say(f"TRAIN_OK rank={r} case={case} {model.__name__} {opt} {dtype} {extra} worst_rel={worst:.2e}")

# ---- Horovod's older Gluon recipe: a plain gluon.Trainer around DistributedOptimizer(SGD(rescale_grad=1/batch)),
# trainer.step(batch). As in Horovod, the Trainer's own rescaling (it sets rescale_grad on the optimizer it holds)
# stays on the wrapper and the wrapped optimizer's 1/batch applies once (before: both, 1/batch squared) ----------
mx.random.seed(77 + r)
dist = mlp("horovod_recipe_")
dist.initialize(mx.init.Xavier())
hvd.broadcast_parameters(dist.collect_params(), root_rank=0)
ref = mlp("horovod_recipe_ref_")
ref.initialize()
for p, q in zip(dist.collect_params().values(), ref.collect_params().values()):
    q.set_data(p.data().copy())
wrapped = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, rescale_grad=1.0 / local))
trainer = gluon.Trainer(dist.collect_params(), wrapped, kvstore=None)
ref_trainer = gluon.Trainer(ref.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9}, kvstore=None)
for step in range(5):
    with autograd.record():
        loss = loss_fn(dist(nd.array(X[step, r * local:(r + 1) * local])), nd.array(Y[step, r * local:(r + 1) * local]))
    loss.backward()
    trainer.step(local)
    with autograd.record():
        ref_loss = loss_fn(ref(nd.array(X[step])), nd.array(Y[step]))
    ref_loss.backward()
    ref_trainer.step(GLOBAL_BATCH)
for (k, p), q in zip(dist.collect_params().items(), ref.collect_params().values()):
    a, b = p.data().asnumpy(), q.data().asnumpy()
    rel = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    assert rel <= 1e-5, f"Horovod's Gluon recipe: {k} differs from the reference by {rel:.2e}"
assert wrapped._optimizer.rescale_grad == 1.0 / local, wrapped._optimizer.rescale_grad
say(f"GLUON_OPT_OK rank={r}")

# ---- 3. a deep model for the overlap timeline ----------------------------------------------
# Between the input layer and the rest, an operator whose backward takes 0.3 s: every other
# gradient is final 0.3 s before the input layer's, so the engine has that long to communicate
# the buckets of the later layers while the step has not even marked the last bucket ready.
class _SlowBackward(mx.operator.CustomOp):
    def forward(self, is_train, req, in_data, out_data, aux):
        self.assign(out_data[0], req[0], in_data[0])

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        time.sleep(0.3)
        self.assign(in_grad[0], req[0], out_grad[0])


@mx.operator.register("aiacc_slow_backward")
class _SlowBackwardProp(mx.operator.CustomOpProp):
    def __init__(self):
        super().__init__(need_top_grad=True)

    def infer_shape(self, in_shape):
        return in_shape, [in_shape[0]], []

    def create_operator(self, ctx, shapes, dtypes):
        return _SlowBackward()


class _Slow(gluon.HybridBlock):
    def hybrid_forward(self, F, x):
        return F.Custom(x, op_type="aiacc_slow_backward")


deep = gluon.nn.HybridSequential(prefix="deep_")
with deep.name_scope():
    deep.add(gluon.nn.Dense(256, activation="relu", in_units=64), _Slow())
    for _ in range(8):
        deep.add(gluon.nn.Dense(256, activation="relu", in_units=256))  # 256 KiB of weight each
    deep.add(gluon.nn.Dense(10, in_units=256))
deep.initialize(mx.init.Xavier())
hvd.broadcast_parameters(deep.collect_params())
deep_trainer = hvd.DistributedTrainer(deep.collect_params(), "sgd", {"learning_rate": 0.01})
xb = nd.array(np.random.default_rng(r).standard_normal((32, 64)).astype(np.float32))
yb = nd.array(np.random.default_rng(r).integers(0, 10, 32).astype(np.float32))
for _ in range(6):
    with autograd.record():
        loss = loss_fn(deep(xb), yb)
    loss.backward()
    deep_trainer.step(32)
nd.waitall()
say(f"DEEP_OK rank={r} steps=6")

# ---- 4. misuse: the same parameter name with a different shape on each rank -----------------
odd = gluon.nn.Dense(4 + r, in_units=3, prefix="mismatch_")
odd.initialize()
odd_trainer = hvd.DistributedTrainer(odd.collect_params(), "sgd", {"learning_rate": 0.1})
with autograd.record():
    out = odd(nd.ones((2, 3))).sum()
out.backward()
text = raises(hvd.TensorMismatchError, lambda: odd_trainer.step(2))
assert "grad.mismatch_weight" in text or "grad.mismatch_bias" in text, text
assert "shape" in text.lower() or "(4" in text, text
say(f"MISMATCH_OK rank={r} {text.splitlines()[0][:160]}")
raises(hvd.TensorMismatchError, lambda: hvd.broadcast_parameters(odd.collect_params(), root_rank=0),
       "param.mismatch_")
# what is not a dict of parameters: a TypeError, and Horovod's ValueError, naming what was given
for exc in (TypeError, ValueError):
    raises(exc, lambda: hvd.broadcast_parameters(list(odd.collect_params().values())),
           "params must be a gluon ParameterDict or a dict, got list")
    raises(exc, lambda: hvd.broadcast_parameters({"w": [1.0]}), "'w' is a list, not a Parameter or NDArray")
say(f"BCAST_MISMATCH_OK rank={r}")

# a parameter frozen on one rank only: the error names it and the rank that has it
frozen = gluon.nn.Dense(2, in_units=3, prefix="frozen_")
frozen.initialize()
if r == 1:
    frozen.bias.grad_req = "null"
frozen_trainer = hvd.DistributedTrainer(frozen.collect_params(), "sgd", {"learning_rate": 0.1})
with autograd.record():
    out = frozen(nd.ones((2, 3))).sum()
out.backward()
counts = "; ".join(f"rank {k}: {1 if k == 1 else 2}" for k in range(n))
holders = "rank 0 has" if n == 2 else "ranks " + ",".join(str(k) for k in range(n) if k != 1) + " have"  # not rank 1
raises(hvd.TensorMismatchError, lambda: frozen_trainer.step(2), f"({counts})", f"only {holders} 'grad.frozen_bias'")

# frozen on one rank only after two steps: that rank's next step made buckets alone and every rank waited for ever
# (the stall warnings named the buckets); now a TensorMismatchError on every rank naming the ranks and gradients
later = gluon.nn.Dense(2, in_units=3, prefix="later_")
later.initialize()
later_trainer = hvd.DistributedTrainer(later.collect_params(), "sgd", {"learning_rate": 0.1})


def later_step():
    with autograd.record():
        out = later(nd.ones((2, 3))).sum()
    out.backward()
    later_trainer.step(2)


for step in range(2):
    later_step()
if r == 1:
    later.weight.grad_req = "null"
raises(hvd.TensorMismatchError, later_step, "rank 1 changed the gradients it averages between steps",
       "did not (now only", "'grad.later_weight'", "set grad_req on every rank alike")

# two blocks made with the same prefix in one trainer (gluon.Trainer takes them; Horovod names by position):
# equal to plain gluon on the whole batch
def twins():
    mx.random.seed(2)
    blocks = [gluon.nn.Dense(3, in_units=3, prefix="twin_") for _ in range(2)]
    for b in blocks:
        b.initialize(mx.init.Uniform(1.0))
    return blocks, [p for b in blocks for p in b.collect_params().values()]


(a, b), ours = twins()
(ra, rb), theirs = twins()
twin_trainer = hvd.DistributedTrainer(ours, "sgd", {"learning_rate": 0.1})
plain = gluon.Trainer(theirs, "sgd", {"learning_rate": 0.1}, kvstore=None)
xs = np.random.default_rng(4).standard_normal((3, n, 3)).astype(np.float32)
for x in xs:
    with autograd.record():
        loss = (b(a(nd.array(x[r:r + 1]))) ** 2).sum()
    loss.backward()
    twin_trainer.step(1)
    with autograd.record():
        loss = (rb(ra(nd.array(x))) ** 2).sum()
    loss.backward()
    plain.step(n)
for p, q in zip(ours, theirs):
    assert np.allclose(p.data().asnumpy(), q.data().asnumpy(), atol=1e-6), p.name
say(f"NAMES_OK rank={r}")

# ---- 5. a backward pass that fails inside MXNet: step() raises MXNet's error, it does not hang ----
class _FailingBackward(mx.operator.CustomOp):
    def forward(self, is_train, req, in_data, out_data, aux):
        self.assign(out_data[0], req[0], in_data[0])

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        raise RuntimeError("backward failed on purpose")


@mx.operator.register("aiacc_failing_backward")
class _FailingBackwardProp(mx.operator.CustomOpProp):
    def __init__(self):
        super().__init__(need_top_grad=True)

    def infer_shape(self, in_shape):
        return in_shape, [in_shape[0]], []

    def create_operator(self, ctx, shapes, dtypes):
        return _FailingBackward()


failing = gluon.nn.Dense(3, in_units=4, prefix="failing_")
failing.initialize()
failing_trainer = hvd.DistributedTrainer(failing.collect_params(), "sgd", {"learning_rate": 0.1})
with autograd.record():
    out = nd.Custom(failing(nd.ones((2, 4))), op_type="aiacc_failing_backward").sum()
out.backward()
# MXNet reports the failed custom backward
raises(mx.base.MXNetError, lambda: failing_trainer.step(2), "kCustomOpBackward")
say(f"BACKWARD_ERROR_OK rank={r}")
hvd.barrier()  # shutdown() stops every rank: wait until all have finished their checks
say(f"OK rank={r}")
hvd.shutdown()
