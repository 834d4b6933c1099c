"""Gradients of a shape unknown on some rank in the FIRST step of a reduction. TensorFlow, 2 ranks, DistributedGradientTape
in tf.function (input_signature with None dimensions) and eagerly.

Works as one process:
- ``rows``: a table tf.Variable(shape=[None, 2]) and a watched tensor of shape [None, 2] (a tf.function input),
  looked up with tf.gather on rank 0 (IndexedSlices whose rows are unknown when traced) and through one_hot @ table on
  rank 1 (dense, (6, 2) when traced, in a bucket): SGD on the table and the gradient of the watched tensor equal one
  process on the global batch, in every step;
- ``quiet``: every rank's gradient reduced on its own (dense of a shape unknown while traced; eagerly None of a
  variable of unknown shape): after the first step, whose collective settles the buckets, a step sends exactly what it
  did before (one allreduce in tf.function, nothing eagerly), and the results equal one process.

An error on every rank naming the gradient (and the shapes and ranks, or what it is on this rank):
- ``none``: eagerly, a variable of unknown shape whose gradient is None on rank 0 (its only gradient) and dense on rank
  1 (in a bucket); ``mixed``: in tf.function, None on rank 0 and dense of an unknown shape on rank 1 (no bucket);
- ``differ``: the tables' known dimensions differ ([None, 2] looked up with tf.gather on rank 0, (6, 3) densely on rank
  1) (it leaves rank 0's allgathers unanswered: after the others);
- ``single`` (last: it leaves rank 0's allreduce unanswered): in tf.function, the watched tensor's gradient dense of an
  unknown shape on rank 0 (its only gradient) and dense of shape (6, 2) on rank 1 (in a bucket).

Before: ``rows`` was a TensorMismatchError on every rank ("shape differs across ranks (rank 0: (*, 2); rank 1: (6,
2))"); ``none``, ``mixed`` and ``single`` waited until the stall inspector (the rank with no bucket never joined the
first step's collective; ``mixed``: nobody had a bucket and rank 1's allreduce was never answered).
Usage: tf_first_unknown.py [scenario ...] (default: all).
"""

import sys

import numpy as np
import tensorflow as tf

tf.get_logger().setLevel("ERROR")

import aiacc  # noqa: E402
import aiacc.tensorflow as hvd  # noqa: E402
from one_process import Checks  # noqa: E402
from report import raises, say  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
assert n == 2, "a 2-rank worker"
PART, STEPS = 4, 4
rng = np.random.default_rng(0)
IDS = rng.integers(0, 6, size=(STEPS, PART * n)).astype(np.int32)
X = rng.normal(size=(STEPS, 6, 2)).astype(np.float32)
INIT = rng.normal(size=(6, 2)).astype(np.float32)
scenarios = sys.argv[1:] or ["rows", "quiet", "none", "mixed", "differ", "single"]
checks = Checks()
ERRORS = (hvd.TensorMismatchError, tf.errors.OpError)


def looked_up(table, ids, kind):
    """The rows ``ids`` of ``table``, summed: with tf.gather (s: an IndexedSlices gradient) or one_hot @ table (d)."""
    if kind == "s":
        return tf.reduce_sum(tf.gather(table, ids))
    return tf.reduce_sum(tf.matmul(tf.one_hot(ids, 6), table))


if "rows" in scenarios:  # rank 0 gathers (rows unknown when traced), rank 1 looks up densely ((6, 2) when traced)
    def loss_of(table, x, ids, kinds):
        """The mean over the rows of each rank's part (one process: every part, each looked up as its rank does)."""
        return sum(looked_up(table, ids[k * PART:(k + 1) * PART], kind) + looked_up(x, ids[k * PART:(k + 1) * PART], kind)
                   for k, kind in enumerate(kinds)) / (PART * len(kinds))

    def run(dist):
        table = tf.Variable(INIT, shape=tf.TensorShape([None, 2]), name="table")
        got = []

        def step(x, ids):
            t = tf.identity(x)  # (a watched tensor, of the input's shape [None, 2])
            with tf.GradientTape() as tape:
                tape.watch(t)
                loss = loss_of(table, t, ids, "sd"[r] if dist else "sd")
            if dist:
                tape = hvd.DistributedGradientTape(tape, name="first_unknown.rows")
            g_table, g_t = tape.gradient(loss, [table, t])
            table.assign_sub(0.1 * tf.convert_to_tensor(g_table))
            return tf.convert_to_tensor(g_t)

        if dist:
            step = tf.function(step, input_signature=[tf.TensorSpec([None, 2]), tf.TensorSpec([None], tf.int32)])
        for k in range(STEPS):
            ids = IDS[k][r * PART:(r + 1) * PART] if dist else IDS[k]
            got.append(step(tf.constant(X[k]), tf.constant(ids)).numpy())
        assert np.abs(table.numpy() - INIT).max() > 1e-3, "the table did not move"
        return [table.numpy()] + got

    checks.close("a table [None, 2] and a watched tensor gathered on rank 0, dense (6, 2) on rank 1 in tf.function",
                 run(False), run(True))

if "quiet" in scenarios:  # every rank reduces the gradient on its own: the first step's collective, then no more
    def sent(fn):
        before = aiacc.summary()["allreduce_requests"]
        out = fn()
        return out, aiacc.summary()["allreduce_requests"] - before

    @tf.function(input_signature=[tf.TensorSpec([None, 2])])
    def squares(x):
        t = tf.identity(x)
        with tf.GradientTape() as tape:
            tape.watch(t)
            loss = tf.reduce_sum(t ** 2) * (r + 1)
        return hvd.DistributedGradientTape(tape, name="first_unknown.quiet.fn").gradient(loss, [t])[0]

    free = tf.Variable(INIT, shape=tf.TensorShape(None), name="free")

    def unused():
        with tf.GradientTape() as tape:
            loss = tf.constant(0.0) * tf.reduce_sum(tf.ones(2))
        return hvd.DistributedGradientTape(tape, name="first_unknown.quiet.eager").gradient(loss, [free])[0]

    counts = {"fn": [], "eager": []}
    for k in range(STEPS):
        g, c = sent(lambda: squares(tf.constant(X[k])))
        counts["fn"].append(c)
        np.testing.assert_allclose(g.numpy(), 2 * X[k] * 1.5, rtol=1e-6)  # ((1 + 2) / 2 ranks): one process
        g, c = sent(unused)
        counts["eager"].append(c)
        assert g is None, g
    assert counts["fn"][0] > 1 and counts["fn"][1:] == [1] * (STEPS - 1), f"allreduces per step: {counts}"
    assert counts["eager"][0] > 0 and counts["eager"][1:] == [0] * (STEPS - 1), f"allreduces per step: {counts}"
    checks.count += 1

if "none" in scenarios:  # eagerly: None (unknown shape) on rank 0, its only gradient; dense in a bucket on rank 1
    free = tf.Variable(INIT, shape=tf.TensorShape(None), name="free")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(free * 2.0) if r == 1 else tf.constant(0.0)
    tape = hvd.DistributedGradientTape(tape, name="first_unknown.none")
    raises(ERRORS, lambda: tape.gradient(loss, [free]), "'first_unknown.none.0.free' is",
           "None, of a source of unknown shape" if r == 0 else "dense", f"(rank {r})")
    checks.count += 1

if "mixed" in scenarios:  # in tf.function: None on rank 0, dense of an unknown shape on rank 1: no bucket anywhere
    free = tf.Variable(INIT, shape=tf.TensorShape(None), name="free")

    @tf.function
    def mixed():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(free * 2.0) if r == 1 else tf.constant(0.0)
        g = hvd.DistributedGradientTape(tape, name="first_unknown.mixed").gradient(loss, [free])[0]
        return tf.zeros(()) if g is None else g

    raises(ERRORS, mixed, "'first_unknown.mixed.0.free' is", f"(rank {r})",
           "None, of a source of unknown shape" if r == 0 else "dense of a shape unknown while traced")
    checks.count += 1

if "differ" in scenarios:  # known dimensions that differ: still an error naming the variable, the shapes, the ranks
    table = tf.Variable(tf.ones([6, 2 + r]), shape=tf.TensorShape([None, 2 + r]), name="table")

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int32)])
    def differ(ids):
        with tf.GradientTape() as tape:
            loss = looked_up(table, ids, "sd"[r])
        return tf.convert_to_tensor(hvd.DistributedGradientTape(tape, name="first_unknown.differ").gradient(
            loss, [table])[0])

    raises(ERRORS, lambda: differ(tf.constant([1, 2, 2])), "first_unknown.differ.0.table", "(*, 2)", "(6, 3)",
           "rank 1")
    checks.count += 1

if "single" in scenarios:  # in tf.function: dense of an unknown shape on rank 0 (no bucket), (6, 2) on rank 1
    @tf.function(input_signature=[tf.TensorSpec([None, 2]), tf.TensorSpec([None], tf.int32)])
    def single(x, ids):
        t = tf.identity(x)
        with tf.GradientTape() as tape:
            tape.watch(t)
            loss = tf.reduce_sum(t ** 2) if r == 0 else looked_up(t, ids, "d")
        return hvd.DistributedGradientTape(tape, name="first_unknown.single").gradient(loss, [t])[0]

    raises(ERRORS, lambda: single(tf.constant(X[0]), tf.constant([1, 2])), "'first_unknown.single.0.Identity' is",
           f"(rank {r})", "dense of a shape unknown while traced" if r == 0 else "dense on this rank")
    checks.count += 1

say(f"OK rank={r} checks={checks.count}")
hvd.shutdown()
