"""Variables Keras names by itself (``add_weight()`` without a name: ``variable``, ``variable_4``, numbered per
process) are matched across ranks by their place, not that name: rank 1 makes an unnamed variable and builds a
layer of the model's kind before the model, so the same variable is ``variable`` on rank 0 and ``variable_2`` on
rank 1 (run with the stall check far away: a wait ends the job at its timeout).

Before, the ranks compared the name: DistributedGradientTape (eagerly, in tf.function) and Keras model.fit with
DistributedOptimizer failed ("gradient 0 has different names across ranks (rank 0: '...0.variable'; rank 1:
'...0.variable_2')") and op=Adasum, which reduces each gradient under that name, waited. Now each equals the
one-process reference (the gradients' average; fit: plain Keras on the whole batch).
"""

import numpy as np
import tensorflow as tf

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.get_logger().setLevel("ERROR")

import keras  # noqa: E402

import aiacc  # noqa: E402
import aiacc.keras as hvd_keras  # noqa: E402
import aiacc.tensorflow as hvd  # noqa: E402
from report import say  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
checks = 0


class Scale(keras.layers.Layer):
    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones")  # no name: Keras numbers it

    def call(self, x):
        return x * self.w


if r == 1:  # Keras' numbering goes on: the model's unnamed variable gets another number here
    extra = keras.Variable(0.0)
    Scale().build((None, 3))


def make():
    return keras.Sequential([keras.Input((3,)), Scale(), keras.layers.Dense(1, kernel_initializer="ones")])


m = make()
names = [v.name for v in m.trainable_variables]
assert names[0] == ("variable" if r == 0 else "variable_2"), names  # (the setup this test is about)
X = np.arange(48, dtype=np.float32).reshape(2, 8, 3) / 10  # rank k's rows: X[k]
Y = np.ones((2, 8, 1), np.float32)


def loss_of(model, x):
    return tf.reduce_sum(model(x) ** 2)


def local_grads(model, x):
    with tf.GradientTape() as tape:
        loss = loss_of(model, x)
    return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]


mine = local_grads(m, X[r])
mean = [np.mean(gs, axis=0) for gs in zip(*hvd.allgather_object(mine))]


def tape_grads(model, x, name, op=hvd.Average):
    with tf.GradientTape() as tape:
        loss = loss_of(model, x)
    return hvd.DistributedGradientTape(tape, name=name, op=op).gradient(loss, model.trainable_variables)


for how, fn in (("eagerly", tape_grads), ("in tf.function", tf.function(tape_grads))):
    got = fn(m, tf.constant(X[r]), f"auto.{how}")
    for g, want in zip(got, mean):
        assert np.allclose(g.numpy(), want, rtol=1e-6), (how, g.numpy(), want)
    checks += 1

# Adasum: each gradient reduced on its own, under its name; the reference: the core's Adasum of the same gradients
got = tape_grads(m, tf.constant(X[r]), "auto.adasum", op=hvd.Adasum)
for k, (g, local) in enumerate(zip(got, mine)):
    want = aiacc.allreduce(local.copy(), op=aiacc.Adasum, name=f"reference.adasum.{k}")
    assert np.allclose(g.numpy(), want, rtol=1e-6), (k, g.numpy(), want)
checks += 1

# model.fit against plain Keras on the whole batch (both ranks' rows)
m.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
m.fit(X[r], Y[r], batch_size=4, epochs=2, shuffle=False, verbose=0)
ref = make()
ref.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
whole_x = np.concatenate([X[0].reshape(2, 4, 3), X[1].reshape(2, 4, 3)], axis=1).reshape(16, 3)  # batch k: both
whole_y = np.ones((16, 1), np.float32)
ref.fit(whole_x, whole_y, batch_size=8, epochs=2, shuffle=False, verbose=0)
for v, w in zip(m.trainable_variables, ref.trainable_variables):
    assert np.allclose(v.numpy(), w.numpy(), rtol=1e-5, atol=1e-6), (v.path, v.numpy(), w.numpy())
checks += 1

say(f"OK rank={r} checks={checks}")
hvd.shutdown()
