"""A variable whose gradient is None on some ranks only (a layer called on rank 0 alone in a step), TensorFlow /
Keras 3 on the TensorFlow backend, each against one process on the whole global batch whose loss has that
layer's output on rank 0's rows only (to float rounding, with Adam):

- ``tape-eager``: DistributedGradientTape eagerly, the branch on the rank inside the step; the layer on rank 0
  only in the first step, then on every rank, on rank 0 only, on no rank (its gradient None everywhere: Adam
  leaves it as one process does), on rank 0 only again;
- ``tape-function``: in tf.function, where None-ness is fixed when each rank traces: the layer on every rank and on
  none (None everywhere stays None), retraced as the phase changes; then a function traced on rank 1 alone (a
  partial batch there) trains as one process; then the layer on rank 0 only: an error on rank 1 naming it (it
  would skip the update rank 0 applies), which goes on after it;
- ``fit``: model.fit (run_eagerly) with DistributedOptimizer and a train_step that branches on the rank, the same
  phases as the eager tape (each phase compiled anew); ``fit-call``: the same with Keras' own train_step and
  call() branching on the rank, also with KERAS_BACKEND=torch (then the default: only this one);
- ``sparse``: an embedding gathered on rank 0 only (IndexedSlices there, None on rank 1) in the first step: every
  rank gets the average of rank 0's slices (before: an error on every rank naming it).

Before, the first step was an error on every rank ("the gradient of '...' is dense on this rank and None or
IndexedSlices on another"), and a later step (the buckets settled with the layer on every rank) waited for the
rank without it until the stall inspector; in tf.function rank 1 went on without the update rank 0 applied; an
IndexedSlices gradient on one rank and None on the other waited for ever. Usage: tf_presence.py [scenario ...]
(default: all).
"""

import sys
import warnings

import numpy as np
import tensorflow as tf

tf.get_logger().setLevel("ERROR")

import keras  # noqa: E402

import aiacc.tensorflow as hvd  # noqa: E402
import aiacc.tensorflow.keras as hvd_keras  # noqa: E402
from one_process import Checks  # noqa: E402
from report import raises, say  # noqa: E402
from tf_models import dense_heads  # noqa: E402

warnings.filterwarnings("ignore", message="Gradients do not exist")  # Keras' warning for the skipped layer
hvd.init()
r, n = hvd.rank(), hvd.size()
PART = 4
B = PART * n
PHASES = ["one", "all", "all", "one", "none", "none", "one"]  # per step: who calls layer c
rng = np.random.default_rng(0)
X = rng.normal(size=(len(PHASES), B, 5)).astype(np.float32)
Y = rng.normal(size=(len(PHASES), B, 1)).astype(np.float32)
mine = slice(r * PART, (r + 1) * PART)
ROW0 = (np.arange(B)[:, None] < PART).astype(np.float32)  # rank 0's rows of the global batch
TORCH = keras.backend.backend() == "torch"
scenarios = sys.argv[1:] or (["fit-call"] if TORCH else ["tape-eager", "tape-function", "fit", "fit-call", "sparse"])
checks = Checks()


same = checks.close


def uses_c(phase):
    """Whether this rank calls layer c (distributed), or on which rows (one process)."""
    return {"one": r == 0, "all": True, "none": False}[phase]


def output(a, b, c, x, phase, dist):
    h = a(x)
    if phase == "none":
        return b(h)
    if dist:
        return b(h) + c(h) if uses_c(phase) else b(h)
    return b(h) + (c(h) * keras.ops.convert_to_tensor(ROW0) if phase == "one" else c(h))


def tape_loop(dist, traced, phases=PHASES):
    a, b, c = dense_heads()
    opt = keras.optimizers.Adam(0.05)
    every = a.trainable_variables + b.trainable_variables + c.trainable_variables

    def step(x, y, phase):
        x, y = tf.cast(x, tf.float32), tf.cast(y, tf.float32)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((output(a, b, c, x, phase, dist) - y) ** 2)
        if dist:
            tape = hvd.DistributedGradientTape(tape, name=f"presence.{traced}")
        grads = tape.gradient(loss, every)
        if phase == "none" or (traced and dist and not uses_c(phase)):  # None on every rank stays None (Keras
            # then leaves c and its moments alone); in a graph, None on this rank too
            assert all(g is None for g in grads[-2:]), grads[-2:]
        else:
            assert all(g is not None for g in grads), "a gradient some rank has is None"
        opt.apply_gradients(zip(grads, every))

    fn = tf.function(step) if traced else step  # (phase: a Python argument, one trace for each)
    for k, phase in enumerate(phases):
        x, y = (X[k][mine], Y[k][mine]) if dist else (X[k], Y[k])
        if phase == "alone":  # rank 1's part in float64: rank 1 alone traces the function anew (same numbers)
            phase = "all"
            x, y = (x.astype(np.float64), y.astype(np.float64)) if dist and r == 1 else (x, y)
        fn(tf.constant(x), tf.constant(y), phase)
    if traced and dist:  # the layer on rank 0 only, in a function: rank 1 traced c's gradient None
        done = [v.numpy().copy() for v in every]  # (compared: rank 0 applies this step's update, rank 1 not)

        def lonely():
            fn(tf.constant(X[0][mine]), tf.constant(Y[0][mine]), "one")
        if r == 1:
            raises((hvd.TensorMismatchError, tf.errors.OpError), lonely,
                   "is None on this rank (rank 1) in this tf.function", "unconnected_gradients")
        else:
            lonely()
        return done
    return every


class Branching(keras.Model):
    """A train_step whose forward pass branches on the rank (phase: who calls c)."""

    def __init__(self, dist):
        super().__init__()
        self.a, self.b, self.c = dense_heads()
        self.dist, self.phase = dist, "all"

    def call(self, x):
        return output(self.a, self.b, self.c, x, "all", False)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((output(self.a, self.b, self.c, x, self.phase, self.dist) - y) ** 2)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


class CallBranching(Branching):
    """Keras' own train_step; call() branches on the rank (any backend)."""

    def call(self, x):
        return output(self.a, self.b, self.c, x, self.phase, self.dist)

    train_step = keras.Model.train_step


def fit(dist, model=Branching):  # (eagerly: in a graph, a gradient None on some ranks only is an error there)
    m = model(dist)
    m(X[0][:1])
    opt = keras.optimizers.Adam(0.05)
    opt = hvd_keras.DistributedOptimizer(opt, name="presence.fit") if dist else opt
    for k, phase in enumerate(PHASES):
        m.phase = phase
        m.compile(optimizer=opt, loss=None if model is Branching else "mse", run_eagerly=not TORCH)
        x, y = (X[k][mine], Y[k][mine]) if dist else (X[k], Y[k])
        m.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    return m.a.weights + m.b.weights + m.c.weights


if "tape-eager" in scenarios:
    same("tape eager", tape_loop(False, False), tape_loop(True, False))
if "tape-function" in scenarios:
    traced = ["all", "none", "all", "alone", "none", "all"]
    same("tape tf.function", tape_loop(False, True, traced), tape_loop(True, True, traced))
if "fit" in scenarios:
    same("fit, train_step branching on the rank", fit(False), fit(True))
if "fit-call" in scenarios:
    same(f"fit on {keras.backend.backend()}, call() branching on the rank", fit(False, CallBranching),
         fit(True, CallBranching))

if "sparse" in scenarios:
    table = tf.Variable(np.arange(12, dtype=np.float32).reshape(4, 3))
    dense = tf.Variable([1.0, 2.0])

    def sparse_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(dense) + (tf.reduce_sum(tf.gather(table, [1, 3])) if r == 0 else 0.0)
        return hvd.DistributedGradientTape(tape, name="sparse").gradient(loss, [dense, table])

    # in the first step: every rank gets the average of rank 0's slices (one process: the same rows, over 2 ranks)
    got_dense, got_table = sparse_step()
    assert isinstance(got_table, tf.IndexedSlices), f"rank {r}: {type(got_table)}"
    assert sorted(got_table.indices.numpy().tolist()) == [1, 3], got_table.indices
    assert np.allclose(got_table.values.numpy(), 1.0 / n) and np.allclose(got_dense.numpy(), 1.0), got_table
    checks.count += 1

say(f"OK rank={r} checks={checks.count}")
hvd.shutdown()
