"""TF1's ``hvd.DistributedOptimizer`` (a ``tf.compat.v1.train.Optimizer``) and a ``DistributedGradientTape`` in a TF1
graph, whose ranks start from different weights, for the check at the second step. A linear model ``x @ w + b``
trained with plain SGD (learning rate 0.1) for 5 steps on data of each rank's own (seeded by the rank); ``w`` differs
across the ranks at the start, ``b`` (zeros) does not, and ``u``, registered local (``register_local_var``), differs
and is left out. Prints the check's warnings (``WARNED``) and the collectives of each step after the first (``COUNTS``),
then ``OK``; with broadcast, the final ``w`` and ``b`` must equal a numpy run of the same averaged SGD from rank 0's
start.

argv: mode, broadcast (0/1)
  graph   a TF1 graph (``tf.Graph().as_default()``) run by a ``MonitoredSession``, ``BroadcastGlobalVariablesHook(0)``;
  v1      ``tf.compat.v1.disable_v2_behavior()`` (TF1's own control flow), a plain ``Session``, broadcast by
          ``session.run(hvd.broadcast_global_variables(0))`` after the initializer;
  eager   ``compute_gradients`` of a loss callable, eagerly, ``hvd.broadcast_variables`` after the first step;
  traced  the same step in a ``tf.function``;
  tape    a ``DistributedGradientTape`` in a TF1 graph, ``apply_gradients`` of a TF1 optimizer, the hook."""

import sys
import warnings

import numpy as np
import tensorflow as tf

mode, broadcast = sys.argv[1], sys.argv[2] == "1"
if mode == "v1":
    tf.compat.v1.disable_v2_behavior()
tf.config.threading.set_inter_op_parallelism_threads(2)
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.get_logger().setLevel("ERROR")

import aiacc.tensorflow as hvd  # noqa: E402
from report import report_same_start  # noqa: E402

hvd.init()
rank, size = hvd.rank(), hvd.size()
LR, STEPS = 0.1, 5


def start(r):
    return np.random.RandomState(r).randn(4, 2).astype(np.float32)


def batch(r, i):
    rng = np.random.RandomState(1000 * r + i)
    return rng.randn(8, 4).astype(np.float32), rng.randn(8, 2).astype(np.float32)


def collectives() -> int:
    s = hvd.summary()
    return sum(s[k] for k in ("allreduce_requests", "allgather", "broadcast", "alltoall", "reducescatter", "barrier",
                              "adasum"))


def reference(broadcast_after_first: bool):
    """``w``, ``b`` after the steps, on rank 0, each step's gradient averaged over the ranks: from rank 0's start, or
    (``broadcast_after_first``) the first step's gradients taken at each rank's own start."""
    w, b = start(0).astype(np.float64), np.zeros(2)
    for i in range(STEPS):
        gw, gb = np.zeros_like(w), np.zeros_like(b)
        for r in range(size):
            x, y = batch(r, i)
            at = start(r) if i == 0 and broadcast_after_first else w
            d = 2.0 * (x @ at + b - y) / y.size  # d mean((xw + b - y)^2) / d out
            gw += x.T @ d / size
            gb += d.sum(0) / size
        w, b = w - LR * gw, b - LR * gb
    return w, b


counts = []
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    if mode in ("graph", "v1", "tape"):
        with tf.Graph().as_default():
            w = tf.compat.v1.get_variable("w", initializer=start(rank))
            b = tf.compat.v1.get_variable("b", initializer=np.zeros(2, np.float32))
            u = tf.compat.v1.get_variable("u", initializer=np.full(2, 1.0 + rank, np.float32))
            x = tf.compat.v1.placeholder(tf.float32, (8, 4))
            y = tf.compat.v1.placeholder(tf.float32, (8, 2))
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y)) + 0.0 * tf.reduce_sum(u)
            if mode == "tape":
                with tf.GradientTape() as tape:
                    tape_loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))
                grads = hvd.DistributedGradientTape(tape).gradient(tape_loss, [w, b])
                train = tf.compat.v1.train.GradientDescentOptimizer(LR).apply_gradients(zip(grads, [w, b]))
            else:
                opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR))
                opt.register_local_var(u)
                train = opt.apply_gradients(opt.compute_gradients(loss, [w, b, u]))
            if mode == "v1":
                bcast = hvd.broadcast_global_variables(0)
                sess = tf.compat.v1.Session()
                sess.run(tf.compat.v1.global_variables_initializer())
                if broadcast:
                    sess.run(bcast)
            else:
                hooks = [hvd.BroadcastGlobalVariablesHook(0)] if broadcast else []
                sess = tf.compat.v1.train.MonitoredSession(hooks=hooks)
            with sess:
                for i in range(STEPS):
                    xs, ys = batch(rank, i)
                    sess.run(train, {x: xs, y: ys})
                    counts.append(collectives())
                final = sess.run([w, b])
    else:
        w = tf.Variable(start(rank), name="w")
        b = tf.Variable(np.zeros(2, np.float32), name="b")
        u = tf.Variable(np.full(2, 1.0 + rank, np.float32), name="u")
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR))
        opt.register_local_var(u)

        def step(xs, ys):
            def loss():
                return tf.reduce_mean(tf.square(tf.matmul(xs, w) + b - ys)) + 0.0 * tf.reduce_sum(u)
            opt.apply_gradients(opt.compute_gradients(loss, [w, b, u]))

        if mode == "traced":
            step = tf.function(step)
        for i in range(STEPS):
            step(*map(tf.constant, batch(rank, i)))
            if i == 0 and broadcast:
                hvd.broadcast_variables([w, b], root_rank=0)
            counts.append(collectives())
        final = [w.numpy(), b.numpy()]
if broadcast:
    for got, want, name in zip(final, reference(mode in ("eager", "traced")), "wb"):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-5), (name, got, want)
report_same_start(rank, seen, counts)
