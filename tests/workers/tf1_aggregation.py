"""TF1's ``hvd.DistributedOptimizer(..., backward_passes_per_step=N)`` in a TF1 graph (Horovod's local gradient
aggregation for legacy optimizers), on 2 or more ranks, against numpy:

* Horovod's own check (``test_local_gradient_aggregation`` and ``_sparse`` of its ``test_tensorflow.py``, which skip on
  TensorFlow 2 before they run): a variable that adds its gradient, rank r's gradient r, N = 4 with
  ``average_aggregated_gradients``: updated on every 4th run only, by the average over the ranks; ``global_step`` read
  before the update counts every run; dense and ``IndexedSlices`` gradients (``sparse_as_dense``).
* A linear model trained by ``MomentumOptimizer`` (its slots made in the update's ``tf.cond``) with N = 2, with and
  without ``average_aggregated_gradients``, a ``register_local_var`` variable (its own summed gradients / size),
  broadcast by ``BroadcastGlobalVariablesHook``: every variable equals a numpy run of the same steps.
* The same without the broadcast: the same-start warning, once, at the second reduction (not at the second run).
* Eagerly, ``compute_gradients`` is a ``NotImplementedError`` naming the setting and what to use.

argv: ``v2`` (a ``tf.Graph`` in a TensorFlow 2 process: resource variables, control flow v2), ``v1``
(``tf.compat.v1.disable_v2_behavior()``: reference variables, TF1's control flow) or ``ref`` (reference variables,
``use_resource=False``, in a graph of a TensorFlow 2 process: control flow v2). Prints ``OK rank=<r> checks=<n>``."""

import sys
import warnings

import numpy as np
import tensorflow as tf

V1 = sys.argv[1] == "v1"
REF = sys.argv[1] in ("v1", "ref")  # reference variables
if V1:
    tf.compat.v1.disable_v2_behavior()
tf.config.threading.set_inter_op_parallelism_threads(2)
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.get_logger().setLevel("ERROR")

import aiacc.tensorflow as hvd  # noqa: E402
from report import raises  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
checks = 0


def check(what, got, want, tol=1e-5):
    global checks
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape and np.allclose(got, want, rtol=tol, atol=tol), f"{what}: {got} != {want}"
    checks += 1


# ---- Horovod's test_local_gradient_aggregation(_sparse) --------------------------------------------------------
def horovod_expected(idx, passes):
    per_run = sum(range(n)) / n / passes  # each rank's gradient r, averaged over the ranks and the passes
    return per_run * passes * ((idx + 1) // passes)


for sparse in (False, True):
    with tf.Graph().as_default():
        class TestOptimizer(tf.compat.v1.train.Optimizer):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.variable = tf.compat.v1.Variable([0.0], use_resource=not REF)
                self.grad = tf.IndexedSlices(tf.constant([float(r)]), tf.constant([0]), tf.constant([1])) if sparse \
                    else tf.constant([float(r)])

            def compute_gradients(self, *args, **kwargs):
                return [(self.grad, self.variable)]

            def _apply_dense(self, grad, var):
                return var.assign_add(grad)

            _resource_apply_dense = _apply_dense

        opt = hvd.DistributedOptimizer(TestOptimizer(name="test", use_locking=False), backward_passes_per_step=4,
                                       average_aggregated_gradients=True, sparse_as_dense=sparse)
        grads_and_vars = opt.compute_gradients()
        global_step = tf.compat.v1.get_variable("test_global_step", initializer=tf.constant(0, dtype=tf.int64),
                                                trainable=False)
        with tf.compat.v1.control_dependencies(g for g, _ in grads_and_vars):
            global_step_before_update = global_step + 0
        with tf.compat.v1.control_dependencies([global_step_before_update]):
            update_op = opt.apply_gradients(grads_and_vars, global_step=global_step)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(tf.compat.v1.local_variables_initializer())
            steps_seen = []
            for idx in range(10):
                step, _ = sess.run((global_step_before_update, update_op))
                steps_seen.append(step)
                check(f"Horovod's aggregation test (sparse={sparse}), run {idx}",
                      sess.run(opt._optimizer.variable.read_value()), [horovod_expected(idx, 4)])
            check(f"global_step counts every run (sparse={sparse})", steps_seen, list(range(10)))


# ---- a model with momentum, its slots made in the update's tf.cond ---------------------------------------------
LR, MOMENTUM, PASSES, RUNS = 0.1, 0.9, 2, 6


def start(k):
    return np.random.RandomState(k).randn(4, 2).astype(np.float32)


def batch(k, i):
    rng = np.random.RandomState(1000 * k + i)
    return rng.randn(8, 4).astype(np.float32), rng.randn(8, 2).astype(np.float32)


def grads_at(w, u, x, y):
    d = 2.0 * (x @ w + u - y) / y.size  # d mean((x w + u - y)^2) / d out
    return x.T @ d, d.sum(0)


def reference(average):
    """Rank ``r``'s ``w`` (every rank's: reduced) and ``u`` (its own, local) after the runs, from rank 0's start."""
    w = start(0).astype(np.float64)
    us = [np.zeros(2) for _ in range(n)]  # (u starts at zero on every rank; it stays each rank's own)
    acc_w, acc_u = np.zeros_like(w), [np.zeros(2) for _ in range(n)]
    sum_w, sum_u = np.zeros_like(w), [np.zeros(2) for _ in range(n)]
    for i in range(RUNS):
        for k in range(n):
            gw, gu = grads_at(w, us[k], *batch(k, i))
            sum_w += gw / n
            sum_u[k] += gu / n  # (a local variable's gradient: divided by the number of ranks, Horovod's scaling)
        if (i + 1) % PASSES == 0:
            scale = 1.0 / PASSES if average else 1.0
            acc_w = MOMENTUM * acc_w + sum_w * scale
            w = w - LR * acc_w
            for k in range(n):
                acc_u[k] = MOMENTUM * acc_u[k] + sum_u[k] * scale
                us[k] = us[k] - LR * acc_u[k]
            sum_w, sum_u = np.zeros_like(w), [np.zeros(2) for _ in range(n)]
    return w, us[r]


def train(average, broadcast):
    """The model's ``w``, ``u``, global_step and the same-start warnings caught."""
    with warnings.catch_warnings(record=True) as seen, tf.Graph().as_default():
        warnings.simplefilter("always")
        w = tf.compat.v1.get_variable("w", initializer=start(r), use_resource=not REF)
        u = tf.compat.v1.get_variable("u", initializer=np.zeros(2, np.float32), use_resource=not REF)
        assert (w.dtype != w.dtype.base_dtype) is REF, w  # (a reference dtype, float32_ref)
        x = tf.compat.v1.placeholder(tf.float32, (8, 4))
        y = tf.compat.v1.placeholder(tf.float32, (8, 2))
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + u - y))
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(LR, MOMENTUM), name=f"agg{average:d}",
                                       backward_passes_per_step=PASSES, average_aggregated_gradients=average)
        opt.register_local_var(u)
        global_step = tf.compat.v1.train.get_or_create_global_step()
        train_op = opt.minimize(loss, global_step=global_step, var_list=[w, u])
        hooks = [hvd.BroadcastGlobalVariablesHook(0)] if broadcast else []
        with tf.compat.v1.train.MonitoredSession(hooks=hooks) as sess:
            for i in range(RUNS):
                xs, ys = batch(r, i)
                sess.run(train_op, {x: xs, y: ys})
            got = sess.run([w, u, global_step])
    return got, [str(m.message) for m in seen if "do not train the same model" in str(m.message)]


for average in (False, True):
    (w_got, u_got, step), warned = train(average, broadcast=True)
    w_want, u_want = reference(average)
    check(f"momentum, average_aggregated_gradients={average}: w", w_got, w_want)
    check(f"momentum, average_aggregated_gradients={average}: the local u", u_got, u_want)
    check(f"momentum, average_aggregated_gradients={average}: global_step", step, RUNS)
    assert not warned, warned
_, warned = train(True, broadcast=False)
assert len(warned) == 1 and "parameter 'w' (1 of 1) on rank 1 are not those of rank 0" in warned[0] \
    and "hvd.BroadcastGlobalVariablesHook(0)" in warned[0], warned
checks += 1

# ---- eagerly: refused, naming why ----------------------------------------------------------------------------
if not V1:
    v = tf.Variable([1.0])
    eager = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0), backward_passes_per_step=2)
    raises(NotImplementedError, lambda: eager.compute_gradients(lambda: tf.reduce_sum(v * v), [v]),
           "backward_passes_per_step=2", "GradientDescentOptimizer", "TF1 graph", "Keras optimizer")
    checks += 1
raises(ValueError, lambda: hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0),
                                                    backward_passes_per_step=0), "backward_passes_per_step", "0")
checks += 1
print(f"OK rank={r} checks={checks}", flush=True)
