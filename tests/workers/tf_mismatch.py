"""Ranks that hand different lists of variables to aiacc.tensorflow fail at once, on every rank, with an
error that names what differs (run with the stall check far away: only these checks can end a step).

* DistributedGradientTape eagerly and in tf.function: a variable more on rank 1, a sublist on rank 1, the same
  number with another shape; with an IndexedSlices gradient (allgathered by position, outside the buckets)
  and a dense variable more on one rank. Before, the ranks' gradient buckets were set up in collectives
  named after their first gradient and their number of gradients, and each rank waited for the other's
  until the stall check (60 s by default).
* broadcast_variables eagerly and in tf.function with a variable more on rank 1: before, rank 0 went on,
  rank 1 waited for the extra broadcast.
* Keras model.fit with DistributedOptimizer over a model with a layer more on rank 1 (with and without
  BroadcastGlobalVariablesCallback).
* After each error, a step over the same variables on every rank still averages the gradients (no stale
  state); two tapes in one tf.function still each get the right average.
"""

import numpy as np
import tensorflow as tf

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.get_logger().setLevel("ERROR")

import keras  # noqa: E402

import aiacc.keras as hvd_keras  # noqa: E402
import aiacc.tensorflow as hvd  # noqa: E402
from report import raises, say  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
MEAN = (n + 1) / 2  # the average over the ranks of r + 1
checks = 0
MISMATCH = (hvd.TensorMismatchError, tf.errors.FailedPreconditionError)


def per_rank(count) -> str:
    """How the errors list each rank's number: ``rank 0: 2; rank 1: 3; ...``, ``count(k)`` for rank k."""
    return "; ".join(f"rank {k}: {count(k)}" for k in range(n))


def expect(words, fn):
    global checks
    raises(MISMATCH, fn, *words)
    checks += 1


def variables(prefix, shapes):
    return [tf.Variable(tf.fill(s, float(k + 1)), name=f"{prefix}{k}") for k, s in enumerate(shapes)]


def tape_step(vs, x, name):
    with tf.GradientTape() as tape:
        loss = tf.add_n([tf.reduce_sum(v * x) for v in vs])
    return hvd.DistributedGradientTape(tape, name=name).gradient(loss, vs)


def good_step(name, fn=tape_step):
    """Every rank over the same variables: the gradient (x = r + 1) averaged."""
    global checks
    vs = variables("ok", [(2, 3), (3,)])
    for g in fn(vs, tf.constant(float(r + 1)), name):
        assert np.allclose(g.numpy(), MEAN), (name, g.numpy())
    checks += 1


counts = [per_rank(lambda k: 3 if k == 1 else 2), "only rank 1 has", "extra"]
for mode, run in (("eagerly", tape_step), ("in tf.function", tf.function(tape_step))):
    vs = variables("v", [(2, 3), (3,)]) + (variables("extra", [(4,)]) if r == 1 else [])
    expect(["number of gradients to average differs across ranks", *counts],
           lambda: run(vs, tf.constant(1.0), f"more.{mode}"))
    # a sublist on rank 1 (its first variable left out)
    vs = variables("v", [(2, 3), (3,), (5,)])
    expect(["number of gradients to average differs across ranks", per_rank(lambda k: 2 if k == 1 else 3)],
           lambda: run(vs[1:] if r == 1 else vs, tf.constant(1.0), f"sublist.{mode}"))
    # as many variables, one of another shape
    vs = variables("v", [(2, 3), (3,) if r == 0 else (4,)])
    expect(["'shape.", ".1.v1'", "shape differs across ranks", "(3,)", "(4,)"],
           lambda: run(vs, tf.constant(1.0), f"shape.{mode}"))
    good_step(f"good.{mode}", run)


# an embedding (IndexedSlices gradient, allgathered under its position's name) and a dense variable more on
# rank 1 in front of it: its allgathers are named apart on the two ranks
def sparse_step(vs, ids, name):
    with tf.GradientTape() as tape:
        loss = tf.add_n([tf.reduce_sum(tf.gather(v, ids)) if v.shape.rank == 2 else tf.reduce_sum(v) for v in vs])
    return hvd.DistributedGradientTape(tape, name=name).gradient(loss, vs)


vs = variables("d", [(3,)]) + (variables("x", [(2,)]) if r == 1 else []) + variables("emb", [(5, 2)])
expect(["number of gradients to average differs across ranks", per_rank(lambda k: 3 if k == 1 else 2)],
       lambda: tf.function(sparse_step)(vs, tf.constant([1, 3]), "sparse"))

# ---- broadcast_variables --------------------------------------------------------------------------------
@tf.function
def bcast_in_function(vs, root_rank):
    hvd.broadcast_variables(vs, root_rank=root_rank)


for mode, bcast in (("eagerly", hvd.broadcast_variables), ("in tf.function", bcast_in_function)):
    vs = variables(f"b{r}_", [(2,), (3,)] + ([(4,)] if r == 1 else []))
    expect(["broadcast_variables: the number of variables differs across ranks", per_rank(lambda k: 3 if k == 1 else 2),
            *(["the ones past 2 are", "b1_2"] if r == 1 else [])], lambda: bcast(vs, root_rank=0))
    vs = variables(f"b{r}_", [(2,), (3,)])
    for v in vs:
        v.assign(v + r)
    bcast(vs, root_rank=0)
    assert [v.numpy().tolist() for v in vs] == [[1.0, 1.0], [2.0, 2.0, 2.0]], mode
    checks += 1

# ---- Keras model.fit: a layer more on rank 1 --------------------------------------------------------------
x, y = np.ones((8, 3), np.float32), np.ones((8, 1), np.float32)


def model(extra):
    layers = [keras.Input((3,)), keras.layers.Dense(4)] + ([keras.layers.Dense(4)] if extra else [])
    m = keras.Sequential(layers + [keras.layers.Dense(1)])
    m.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    return m


expect(["number of gradients to average differs across ranks", per_rank(lambda k: 6 if k == 1 else 4)],
       lambda: model(r == 1).fit(x, y, batch_size=4, epochs=1, verbose=0))
expect(["BroadcastGlobalVariablesCallback.model: the number of variables differs", per_rank(lambda k: 6 if k == 1 else 4)],
       lambda: model(r == 1).fit(x, y, batch_size=4, epochs=1, verbose=0,
                                 callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)]))
model(False).fit(x, y, batch_size=4, epochs=1, verbose=0,
                 callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
checks += 1


# ---- two tapes in one tf.function, unnamed: each its own set, whatever order their ops run in -------------
@tf.function
def two_tapes(a, b, x):
    with tf.GradientTape() as ta:
        la = tf.reduce_sum(a[0] * x) + tf.reduce_sum(a[1] * x)
    with tf.GradientTape() as tb:
        lb = tf.reduce_sum(b[0] * x * 2.0)
    return hvd.DistributedGradientTape(ta).gradient(la, a), hvd.DistributedGradientTape(tb).gradient(lb, b)


a, b = variables("a", [(2,), (3,)]), variables("c", [(4,)])
for step in range(2):
    ga, gb = two_tapes(a, b, tf.constant(float(r + 1)))
    assert all(np.allclose(g.numpy(), MEAN) for g in ga) and np.allclose(gb[0].numpy(), 2 * MEAN), (ga, gb)
    checks += 1

say(f"OK rank={r} checks={checks}")
hvd.shutdown()
