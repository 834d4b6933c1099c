"""Keras 2 (``tf.keras`` is ``tf_keras`` under TF_USE_LEGACY_KERAS=1, set by the test) through aiacc.tensorflow.keras,
as a Horovod Keras 2 script uses it: ``model.fit`` with the new and the legacy optimizers and Horovod's callbacks
(the warmup's momentum correction too), a custom loop in a tf.function with ``backward_passes_per_step``, local
layers, SyncBatchNormalization, ``hvd.load_model`` of .keras and .h5 files, each equal to one process on the global
batch; a sparse gradient that accumulation cannot add up is an error naming it."""

import logging
import os
import shutil
import tempfile

import numpy as np
import tensorflow as tf

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.get_logger().setLevel("ERROR")

import aiacc.tensorflow as hvd_tf  # noqa: E402
import aiacc.tensorflow.keras as hvd  # noqa: E402
from aiacc.tensorflow.keras._keras2 import _Keras2DistributedOptimizer  # noqa: E402
from report import raises, say  # noqa: E402

assert os.environ.get("TF_USE_LEGACY_KERAS") == "1"
keras = tf.keras
assert keras.__name__.startswith("tf_keras"), keras.__name__

hvd.init()
r, n = hvd.rank(), hvd.size()
checks = 0
if r == 0:  # one more layer here: Keras 2 numbers every later layer (and its variables' names) otherwise on rank 0
    keras.layers.Dense(1)(tf.zeros((1, 1)))


def close(what, got, want, tol=1e-5):
    global checks
    for k, (a, b) in enumerate(zip(got, want)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape, f"{what}[{k}]: shape {a.shape} != {b.shape}"
        assert np.allclose(a, b, rtol=tol, atol=tol), f"{what}[{k}] on rank {r}: max err {np.abs(a - b).max()}"
    checks += 1


def model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.layers.Dense(5, activation="tanh", input_shape=(4,)), keras.layers.Dense(2)])


rng = np.random.default_rng(7)
X = rng.normal(size=(4 * n, 4)).astype(np.float32)
Y = rng.normal(size=(4 * n, 2)).astype(np.float32)
mine = slice(4 * r, 4 * (r + 1))

# ---- model.fit: each rank starts from its own weights; the callback broadcasts rank 0's; the averaged steps equal
# one process on the whole batch (new and legacy optimizers, with momentum state)
for make in (lambda: keras.optimizers.SGD(0.1, momentum=0.9), lambda: keras.optimizers.legacy.Adam(0.01)):
    start = model(100).get_weights()  # rank 0's weights: the reference starts there
    m = model(100 + r)
    opt = hvd.DistributedOptimizer(make())
    assert type(opt).__name__ == type(make()).__name__ and isinstance(opt, type(make()))
    m.compile(opt, "mse")
    history = m.fit(X[mine], Y[mine], batch_size=4, epochs=3, shuffle=False, verbose=0,
                    callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()])
    ref = model(0)
    ref.set_weights(start)
    ref.compile(make(), "mse")
    ref.fit(X, Y, batch_size=4 * n, epochs=3, shuffle=False, verbose=0)
    close(f"fit with {type(make()).__module__}", m.get_weights(), ref.get_weights())
    losses = hvd_tf.allgather_object(history.history["loss"])
    assert losses[0] == losses[-1], f"MetricAverageCallback: the ranks logged {losses}"
    checks += 1

# ---- a custom loop in a tf.function, Horovod's backward_passes_per_step=2: every second call applies the average
# across ranks of the sum of the two micro-batches' gradients; iterations count every call (Horovod's wrapper)
for average in (False, True):
    m = model(3)
    variables = m.trainable_variables
    start = [v.numpy() for v in variables]
    opt = hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(0.05), backward_passes_per_step=2,
                                   average_aggregated_gradients=average)

    @tf.function
    def micro_step(x, y):
        def loss():
            return tf.reduce_mean(tf.square(m(x) - y))

        opt.apply_gradients(opt._compute_gradients(loss, variables))

    ref = model(3)
    for step in range(4):
        halves = [X[mine][0:2], X[mine][2:4]], [Y[mine][0:2], Y[mine][2:4]]
        for x, y in zip(*halves):
            micro_step(tf.constant(x), tf.constant(y))
        # the reference: per micro-batch k, the mean over ranks of their loss gradients, summed (or averaged) over k
        total = None
        for k in range(2):
            xs = np.concatenate([X[4 * q:4 * q + 4][2 * k:2 * k + 2] for q in range(n)])
            ys = np.concatenate([Y[4 * q:4 * q + 4][2 * k:2 * k + 2] for q in range(n)])
            with tf.GradientTape() as tape:
                # each rank's mean over its 2 rows, averaged over ranks = the mean over the 2n rows
                loss = tf.reduce_mean(tf.square(ref(xs) - ys))
            g = tape.gradient(loss, ref.trainable_variables)
            total = g if total is None else [a + b for a, b in zip(total, g)]
        for v, g in zip(ref.trainable_variables, total):
            v.assign_sub(0.05 * (g / 2 if average else g))
        close(f"backward_passes_per_step=2 average={average} step {step}", [v.numpy() for v in variables],
              [v.numpy() for v in ref.trainable_variables])
    assert int(opt.iterations.numpy()) == 8 and int(opt._agg_helper.counter.numpy()) == 0, \
        (int(opt.iterations.numpy()), int(opt._agg_helper.counter.numpy()))
    checks += 1

# ---- a local layer (PartialDistributedOptimizer): its gradients stay on the rank, divided by the ranks
m = model(5)
opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=[m.layers[0]])
with tf.GradientTape() as tape:
    loss = tf.reduce_mean(tf.square(m(X[mine]) - Y[mine]))
got = opt._compute_gradients(loss, m.trainable_variables, tape=tape)
with tf.GradientTape() as tape:
    own = tape.gradient(tf.reduce_mean(tf.square(m(X[mine]) - Y[mine])), m.trainable_variables)
with tf.GradientTape() as tape:
    whole = tape.gradient(tf.reduce_mean(tf.square(m(X) - Y)), m.trainable_variables)
close("PartialDistributedOptimizer", [g for g, _ in got], [o / n for o in own[:2]] + whole[2:])

# ---- accumulation cannot add up a sparse gradient: an error naming the variable
emb = keras.layers.Embedding(10, 3)
emb.build((None,))
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
raises(ValueError, lambda: opt._compute_gradients(lambda: tf.reduce_sum(emb(tf.constant([1, 2]))),
                                                  emb.trainable_variables), "embeddings", "sparse_as_dense=True")
checks += 1

# ---- SyncBatchNormalization of aiacc.tensorflow is a tf.keras (Keras 2) layer here: uneven batches, global statistics
SyncBN = hvd_tf.SyncBatchNormalization
assert issubclass(SyncBN, keras.layers.BatchNormalization)
rows = [3 + q for q in range(n)]
data = np.random.default_rng(11).normal(size=(sum(rows), 3)).astype(np.float32)
sync, plain = SyncBN(momentum=0.5), keras.layers.BatchNormalization(momentum=0.5)
lo = sum(rows[:r])
y = sync(tf.constant(data[lo:lo + rows[r]]), training=True)
want = plain(tf.constant(data), training=True)
close("SyncBatchNormalization", [y, sync.moving_mean, sync.moving_variance],
      [want[lo:lo + rows[r]], plain.moving_mean, plain.moving_variance], tol=1e-4)

# ---- hvd.load_model: a model saved on rank 0 after some steps (compiled with the wrapper or not) comes back on every
# rank with its optimizer distributed (the wrapper's mixin, the saved class) and the saved state (iterations, slots)
# loaded into it; 2 more steps on each rank's half equal one process that loaded the file with
# tf.keras.models.load_model
# and trains on the whole batch. Keras 2 saves no legacy optimizer's state in a .keras file (plain load: none either).
def optimizer_state(opt):
    return [v.numpy() for v in (opt.variables() if callable(opt.variables) else opt.variables)]


where = hvd_tf.broadcast_object(tempfile.mkdtemp() if r == 0 else None)
for make, ext, legacy, wrapped in ((lambda: keras.optimizers.Adam(0.01), "keras", False, True),
                                   (lambda: keras.optimizers.Adam(0.01), "h5", False, False),
                                   (lambda: keras.optimizers.legacy.Adam(0.01), "h5", True, True),
                                   (lambda: keras.optimizers.legacy.Adam(0.01), "keras", True, False)):
    what = f"load_model {type(make()).__module__}.Adam .{ext} saved {'wrapped' if wrapped else 'plain'}"
    path = os.path.join(where, f"saved.{ext}")
    if wrapped:  # a Horovod script: every rank trains, rank 0 saves
        m = model(30)
        m.compile(hvd.DistributedOptimizer(make()), "mse")
        m.fit(X[mine], Y[mine], batch_size=2, epochs=1, shuffle=False, verbose=0)
    else:  # (on every rank: Keras 2 numbers layers per process, and the names must stay alike for what follows)
        m = model(30)
        m.compile(make(), "mse")
        m.fit(X, Y, batch_size=2 * n, epochs=1, shuffle=False, verbose=0)
    if r == 0:
        m.save(path)
    hvd_tf.barrier()
    loaded = hvd.load_model(path, legacy_opts=legacy)
    ref = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, _Keras2DistributedOptimizer), f"{what}: {type(loaded.optimizer).__mro__}"
    assert isinstance(loaded.optimizer, type(make())) and not isinstance(ref.optimizer, _Keras2DistributedOptimizer)
    state = optimizer_state(loaded.optimizer)
    assert len(state) == (0 if legacy and ext == "keras" else 9), (what, len(state))  # iterations, 2 slots x 4
    close(f"{what}: loaded state", state, optimizer_state(ref.optimizer), tol=0)
    assert int(loaded.optimizer.iterations.numpy()) == (0 if legacy and ext == "keras" else 2), what
    loaded.fit(X[mine], Y[mine], batch_size=2, epochs=1, shuffle=False, verbose=0)
    ref.fit(np.concatenate([X[4 * q:4 * q + 4][k:k + 2] for k in (0, 2) for q in range(n)]),
            np.concatenate([Y[4 * q:4 * q + 4][k:k + 2] for k in (0, 2) for q in range(n)]),
            batch_size=2 * n, epochs=1, shuffle=False, verbose=0)
    close(f"{what}: 2 more steps", loaded.get_weights() + optimizer_state(loaded.optimizer),
          ref.get_weights() + optimizer_state(ref.optimizer))
hvd_tf.barrier()
if r == 0:
    shutil.rmtree(where)


# ---- LearningRateWarmupCallback(momentum_correction=True), Horovod's: with a legacy optimizer (momentum a
# hyperparameter variable) the momentum seen inside each warmup batch is momentum * lr / previous lr, given back at
# the batch's end; fit equals one process on the whole batch that applies the same learning rates and momenta
class Probe(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen, self.after = [], []

    def on_train_batch_begin(self, batch, logs=None):
        opt = self.model.optimizer
        self.seen.append((float(np.asarray(opt.learning_rate)), float(np.asarray(opt.momentum))))

    def on_train_batch_end(self, batch, logs=None):
        self.after.append(float(np.asarray(self.model.optimizer.momentum)))


class Replay(keras.callbacks.Callback):
    def __init__(self, schedule):
        super().__init__()
        self.schedule, self.step = schedule, 0

    def on_train_batch_begin(self, batch, logs=None):
        self.model.optimizer.learning_rate, self.model.optimizer.momentum = self.schedule[self.step]
        self.step += 1


m = model(40)
m.compile(hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(0.1, momentum=0.9)), "mse")
warmup = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=2, momentum_correction=True)
probe = Probe()
m.fit(X[mine], Y[mine], batch_size=2, epochs=3, shuffle=False, verbose=0,
      callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), warmup, probe])
lrs = [warmup.learning_rate_at(e, b) for e in range(2) for b in range(2)]
want = [(lr, 0.9 * lr / prev) for lr, prev in zip(lrs, [0.1] + lrs)] + [(lrs[-1], 0.9)] * 2
close("momentum_correction: lr and momentum in each batch", probe.seen, want)
close("momentum_correction: momentum after each batch", [probe.after], [[0.9] * 6])
ref = model(40)
ref.compile(keras.optimizers.legacy.SGD(0.1, momentum=0.9), "mse")
ref.fit(np.concatenate([X[4 * q:4 * q + 4][k:k + 2] for k in (0, 2) for q in range(n)]),
        np.concatenate([Y[4 * q:4 * q + 4][k:k + 2] for k in (0, 2) for q in range(n)]),
        batch_size=2 * n, epochs=3, shuffle=False, verbose=0, callbacks=[Replay(want)])
close("momentum_correction: fit", m.get_weights(), ref.get_weights())

# Keras 2's new optimizers compile their momentum (a Python number) into the train function: a warning says so
# (no correction then, as before)
logged = []
handler = logging.Handler()
handler.emit = logged.append
logging.getLogger(hvd.callbacks.__name__).addHandler(handler)
m = model(41)
m.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), "mse")
m.fit(X[mine], Y[mine], batch_size=4, epochs=1, verbose=0,
      callbacks=[hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=1)])
text = " ".join(rec.getMessage() for rec in logged)
if r == 0:  # (rank 0 warns, once)
    assert "momentum_correction is not applied to SGD" in text and "tf.keras.optimizers.legacy" in text, text
else:
    assert "momentum_correction" not in text, text
logging.getLogger(hvd.callbacks.__name__).removeHandler(handler)
checks += 1

# an optimizer given by name (Keras' compile takes names): Keras 2's here (it was Keras 3's, which tf_keras' compile
# refused: "Could not interpret optimizer identifier: <keras.src.optimizers.adam.Adam ...>")
named = hvd.DistributedOptimizer("adam")
assert isinstance(named, keras.optimizers.Adam), type(named).__mro__
m = model(42)
m.compile(named, "mse")
m.fit(X[mine], Y[mine], batch_size=4, epochs=1, verbose=0)
checks += 1

# ---- mixed_float16: compile wraps the wrapper in Keras 2's LossScaleOptimizer; the averaged (scaled) gradients
# are unscaled there and every rank takes the same finite-or-skip branch, so the ranks stay equal
keras.mixed_precision.set_global_policy("mixed_float16")
for make in (keras.optimizers.Adam, keras.optimizers.legacy.Adam):
    m = model(21)
    m.compile(hvd.DistributedOptimizer(make(0.01)), "mse")
    assert type(m.optimizer).__name__.startswith("LossScaleOptimizer"), type(m.optimizer)
    m.fit(X[mine], Y[mine], batch_size=2, epochs=2, shuffle=False, verbose=0)
    weights = hvd_tf.allgather_object(m.get_weights())
    close(f"mixed_float16 {make.__module__}", weights[r], weights[0], tol=0)
# with backward_passes_per_step=2 around a legacy optimizer: the LossScaleOptimizer's cond paired the wrapper's int64
# with its skip branch's op, a TypeError at the first step
m = model(22)
start = m.get_weights()
m.compile(hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(0.1), backward_passes_per_step=2), "mse")
assert type(m.optimizer).__name__.startswith("LossScaleOptimizer"), type(m.optimizer)
m.fit(X[mine], Y[mine], batch_size=2, epochs=1, shuffle=False, verbose=0)
assert int(m.optimizer.iterations.numpy()) == len(X[mine]) // 2, int(m.optimizer.iterations.numpy())
assert not all(np.array_equal(a, b) for a, b in zip(m.get_weights(), start)), "the accumulated steps changed nothing"
weights = hvd_tf.allgather_object(m.get_weights())
close("mixed_float16 legacy backward_passes_per_step=2", weights[r], weights[0], tol=0)
keras.mixed_precision.set_global_policy("float32")

say(f"OK rank={r} checks={checks}")
