"""aiacc.tensorflow / aiacc.keras with AIACC_ENABLE unset or 0: nothing starts, nothing changes.

Importing the adapters starts no thread and no MPI; the tape and the optimizer wrappers hand back the
user's own objects (a Keras or TF1 DistributedOptimizer asked to accumulate gradients still accumulates);
collectives return their input (eager and in tf.function); model.fit with the
callbacks trains exactly like plain Keras.
"""

import sys
import threading

threads_before = threading.active_count()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.get_logger().setLevel("ERROR")

import keras  # noqa: E402

threads_frameworks = threading.active_count()
import aiacc.keras as hvd  # noqa: E402
import aiacc.tensorflow as hvd_tf  # noqa: E402
from report import raises, say  # noqa: E402

assert "mpi4py.MPI" not in sys.modules, "importing the adapters started MPI"
assert threading.active_count() == threads_frameworks, "importing the adapters started a thread"

hvd.init()
assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()) == (0, 1, 0, 1)
assert not hvd.is_enabled() and "mpi4py.MPI" not in sys.modules

x = tf.constant(np.arange(6, dtype=np.float32).reshape(2, 3))
for wrap in (lambda f: f, tf.function):
    out = wrap(lambda t: (hvd_tf.allreduce(t), hvd_tf.allgather(t), hvd_tf.broadcast(t, 0), hvd_tf.alltoall(t),
                          hvd_tf.reducescatter(t), hvd_tf.grouped_allreduce([t, t])))(x)
    for got in tf.nest.flatten(out):
        assert np.array_equal(got.numpy(), x.numpy()), got

# the wrappers return the user's objects
with tf.GradientTape() as tape:
    v = tf.Variable([1.0, 2.0])
    loss = tf.reduce_sum(v * v)
assert hvd_tf.DistributedGradientTape(tape) is tape
assert np.array_equal(tape.gradient(loss, v).numpy(), [2.0, 4.0])
adam = keras.optimizers.Adam(0.01)
assert hvd.DistributedOptimizer(adam) is adam
# the wrappers' argument checks run switched off too (the errors a launched job meets at its first step)
raises(ValueError, lambda: hvd_tf.DistributedGradientTape(tape, compression="fp8"), "compression='fp8' is not supported")
raises(TypeError, lambda: hvd_tf.DistributedGradientTape(42), "DistributedGradientTape wraps a tf.GradientTape, not int")
# Horovod's num_groups / groups: a count or lists (which change nothing here), checked as Horovod does
raises(ValueError, lambda: hvd_tf.DistributedGradientTape(tape, groups=-1), "DistributedGradientTape: groups=-1")
raises(ValueError, lambda: hvd_tf.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                                       num_groups="x"), "DistributedOptimizer: num_groups='x'")
raises(ValueError, lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), groups="abc"),
       "DistributedOptimizer: groups='abc'")
assert hvd_tf.DistributedGradientTape(tape, num_groups=2, groups=[[v]]) is tape
raises(ValueError, lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="fp8"),
       "compression='fp8' is not supported")
built = keras.optimizers.SGD(0.1)
built.build([v])
raises(ValueError, lambda: hvd.DistributedOptimizer(built), "wrap the optimizer before it is built")

# model.fit with the callbacks: the same weights as plain Keras
rng = np.random.default_rng(0)
xs, ys = rng.standard_normal((64, 5)).astype(np.float32), rng.integers(0, 3, 64)


def fit(distributed):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    opt = keras.optimizers.SGD(0.1)
    callbacks = []
    if distributed:
        opt = hvd.DistributedOptimizer(opt)
        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(xs, ys, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    return model.get_weights(), history.history


(w_dist, h_dist), (w_plain, h_plain) = fit(True), fit(False)
for a, b in zip(w_dist, w_plain):
    assert np.array_equal(a, b)
assert h_dist == h_plain, (h_dist, h_plain)

# backward_passes_per_step > 1 is the wrapper's own accumulation, which the script relies on: switched off it
# still accumulates (the sum of 2 micro-batches, Horovod's default), reducing nothing
sgd = keras.optimizers.SGD(1.0)
acc = hvd.DistributedOptimizer(sgd, backward_passes_per_step=2)
assert acc is not sgd and isinstance(acc, keras.optimizers.SGD)
v = tf.Variable([0.0, 0.0])
acc.apply([tf.constant([1.0, 2.0])], [v])
assert np.array_equal(v.numpy(), [0.0, 0.0]), v.numpy()
acc.apply([tf.constant([3.0, 4.0])], [v])
assert np.array_equal(v.numpy(), [-4.0, -6.0]), v.numpy()
# a TF1 optimizer too (in a graph, a Session): switched off it was handed back as it is and applied every run
with tf.Graph().as_default():
    w = tf.compat.v1.get_variable("w", initializer=tf.constant([0.0, 0.0]))
    target = tf.compat.v1.placeholder(tf.float32, [2])
    tf1 = hvd_tf.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0), backward_passes_per_step=2)
    train = tf1.minimize(0.5 * tf.reduce_sum((w - target) ** 2))  # gradient w - target
    with tf.compat.v1.Session() as session:
        session.run(tf.compat.v1.global_variables_initializer())
        session.run(tf.compat.v1.local_variables_initializer())
        for t, expected in (([1.0, 2.0], [0.0, 0.0]), ([3.0, 4.0], [4.0, 6.0])):
            session.run(train, {target: t})
            assert np.array_equal(session.run(w), expected), (session.run(w), expected)
assert "mpi4py.MPI" not in sys.modules
say("OK rank=0")
