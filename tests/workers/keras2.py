"""Keras 2 (``tf.keras`` is ``tf_keras`` under TF_USE_LEGACY_KERAS=1, set by the test) through aiacc.tensorflow.keras,
as a Horovod Keras 2 script uses it: ``model.fit`` with the new and the legacy optimizers and Horovod's callbacks,
a custom loop in a tf.function with ``backward_passes_per_step``, local layers, SyncBatchNormalization, each equal
to one process on the global batch; a sparse gradient that accumulation cannot add up is an error naming it."""

import os

import numpy as np
import tensorflow as tf

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.get_logger().setLevel("ERROR")

import aiacc.tensorflow as hvd_tf  # noqa: E402
import aiacc.tensorflow.keras as hvd  # noqa: E402
from report import raises, say  # noqa: E402

assert os.environ.get("TF_USE_LEGACY_KERAS") == "1"
keras = tf.keras
assert keras.__name__.startswith("tf_keras"), keras.__name__

hvd.init()
r, n = hvd.rank(), hvd.size()
checks = 0


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
keras.mixed_precision.set_global_policy("float32")

say(f"OK rank={r} checks={checks}")
