"""A rank whose gradients are ALL IndexedSlices (it has no bucket at all) in the first step of a reduction, and tables
IndexedSlices on every rank whose shapes differ. TensorFlow / Keras 3 on the TensorFlow backend, 2 ranks, each against
one process on the whole global batch: a model that is only an Embedding(6, 2) table, looked up with tf.gather
(IndexedSlices: s), densely (one_hot @ table: d) or not at all (-) on each rank's batch.

- ``tape`` / ``keras``: DistributedGradientTape eagerly, Keras' DistributedOptimizer in a custom loop (Adam), the kinds
  changing per step from a first step in which rank 0 has only IndexedSlices and rank 1 the table dense;
- ``none``: the tape eagerly (SGD), a first step IndexedSlices on rank 0 and None on rank 1;
- ``function``: the tape in tf.function, IndexedSlices on rank 0 and dense on rank 1 in every step (one trace);
- ``fit``: model.fit (SGD) of a model whose call() looks the table up as its rank does;
- ``quiet``: the table IndexedSlices on every rank, eagerly and in tf.function: after the first step (whose check of
  the tables' shapes is a collective) a step sends no allreduce at all, only the two allgathers;
- ``shapes``: tables of other shapes under one name, IndexedSlices on every rank (a vocabulary built from each rank's
  shard): an error on every rank naming the variable, both shapes and the ranks, eagerly and in tf.function, rows
  (6 vs 7) and row width (2 vs 3).

Before: ``tape``, ``keras``, ``none``, ``function`` and ``fit`` waited until the stall inspector (rank 0 sent its
allgathers and never joined rank 1's first-step collective of the buckets); ``shapes`` crashed on rank 0 with
"segment_ids[4] = 6 is out of range" in unsorted_segment_sum while rank 1 got the gradient of another table.
Usage: tf_sparse_only.py [scenario ...] (default: all).
"""

import sys

import numpy as np
import tensorflow as tf

tf.get_logger().setLevel("ERROR")

import keras  # noqa: E402

import aiacc  # noqa: E402
import aiacc.tensorflow as hvd  # noqa: E402
import aiacc.tensorflow.keras as hvd_keras  # noqa: E402
from one_process import Checks  # noqa: E402
from report import raises, say  # noqa: E402
from tf_models import lookup  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
assert n == 2, "a 2-rank worker"
PART = 4
B = PART * n
KINDS = ["sd", "ds", "ss", "dd", "s-", "-d"]  # per step, rank k's kind of the table's gradient (first: s on rank 0)
STEPS = len(KINDS)
rng = np.random.default_rng(0)
IDS = rng.integers(0, 6, size=(STEPS, B, 2)).astype(np.int32)
Y = rng.normal(size=(STEPS, B, 1)).astype(np.float32)
mine = slice(r * PART, (r + 1) * PART)
scenarios = sys.argv[1:] or ["tape", "keras", "none", "function", "fit", "quiet", "shapes"]
checks = Checks()
OPTIMIZERS = {"adam": lambda: keras.optimizers.Adam(0.05), "sgd": lambda: keras.optimizers.SGD(0.1)}


def table():
    keras.utils.set_random_seed(1)
    emb = keras.layers.Embedding(6, 2)
    emb.build((None, 2))
    return emb


def output(emb, ids, kinds, dist):
    """The rows of ``ids`` summed per sample, looked up as each rank does (one process: each rank's rows so); zeros
    where no rank looks them up."""
    if dist:
        term = lookup(emb, ids, kinds[r])
        return tf.zeros([PART, 1]) if term is None else term
    terms = [lookup(emb, ids[k * PART:(k + 1) * PART], kind) for k, kind in enumerate(kinds)]
    return tf.concat([tf.zeros([PART, 1]) if t is None else t for t in terms], 0)


def batch(k, dist):
    rows = mine if dist else slice(None)
    return tf.constant(IDS[k][rows]), tf.constant(Y[k][rows])


def loop(dist, how, kinds, opt_name, tag):
    emb = table()
    opt = OPTIMIZERS[opt_name]()
    if dist and how == "keras":
        opt = hvd_keras.DistributedOptimizer(opt, name=f"sparse_only.opt.{tag}")
    every = emb.trainable_variables

    def step(ids, y, kind):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((output(emb, ids, kind, dist) - y) ** 2)
        if dist and how != "keras":
            tape = hvd.DistributedGradientTape(tape, name=f"sparse_only.{tag}")
        grads = tape.gradient(loss, every)
        if dist and how == "tape":  # every rank got the same gradient of the table
            g = grads[0]
            assert (g is None) == (set(kind) == {"-"}), (kind, g)
            everyone = hvd.allgather_object(tf.convert_to_tensor(g).numpy().tolist())
            assert everyone[r] == everyone[0], f"rank {r}: another table gradient than rank 0's ({kind})"
        opt.apply_gradients(zip(grads, every))

    run = tf.function(step) if how == "function" else step
    for k, kind in enumerate(kinds):
        run(*batch(k, dist), kind)
    moved = np.abs(every[0].numpy() - table().embeddings.numpy()).max()
    assert moved > 1e-3, f"{how}: the table did not move"
    return every


if "tape" in scenarios:
    checks.close("tape eagerly, all IndexedSlices on rank 0 in the first step", loop(False, "tape", KINDS, "adam", "t"),
                 loop(True, "tape", KINDS, "adam", "t"))
if "keras" in scenarios:
    checks.close("keras DistributedOptimizer, all IndexedSlices on rank 0 in the first step",
                 loop(False, "keras", KINDS, "adam", "k"), loop(True, "keras", KINDS, "adam", "k"))
if "none" in scenarios:
    kinds = ["s-", "sd", "-s", "ds"]
    checks.close("tape eagerly, IndexedSlices on rank 0 and None on rank 1 in the first step",
                 loop(False, "tape", kinds, "sgd", "n"), loop(True, "tape", kinds, "sgd", "n"))
if "function" in scenarios:
    checks.close("tape in tf.function, IndexedSlices on rank 0 and dense on rank 1",
                 loop(False, "tape", ["sd"] * STEPS, "adam", "f"), loop(True, "function", ["sd"] * STEPS, "adam", "f"))


class Lookup(keras.Model):
    """The table's rows of the ids, looked up as this rank does (one process: each rank's rows so)."""

    def __init__(self, dist):
        super().__init__()
        self.emb = table()
        self.dist = dist

    def call(self, ids):
        return output(self.emb, ids, "sd", self.dist)


if "fit" in scenarios:
    def fit(dist):
        model = Lookup(dist)
        opt = OPTIMIZERS["sgd"]()
        model.compile(optimizer=hvd_keras.DistributedOptimizer(opt, name="sparse_only.fit") if dist else opt,
                      loss="mse")
        rows = mine if dist else slice(None)  # (step k's global batch is every rank's k-th batch)
        ids, y = (a[:, rows].reshape((-1,) + a.shape[2:]) for a in (IDS, Y))
        model.fit(ids, y, batch_size=PART if dist else B, epochs=1, shuffle=False, verbose=0)
        return model.emb.trainable_variables

    checks.close("model.fit, IndexedSlices on rank 0 and dense on rank 1", fit(False), fit(True))

if "quiet" in scenarios:  # the shapes' check is the first step's only: later steps send no allreduce
    for how in ("tape", "function"):
        emb = table()
        opt = OPTIMIZERS["sgd"]()

        def step(ids, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((tf.reduce_sum(emb(ids), axis=[1, 2])[:, None] - y) ** 2)
            tape = hvd.DistributedGradientTape(tape, name=f"sparse_only.quiet.{how}")
            grads = tape.gradient(loss, emb.trainable_variables)
            assert isinstance(grads[0], tf.IndexedSlices), grads[0]
            opt.apply_gradients(zip(grads, emb.trainable_variables))

        run = tf.function(step) if how == "function" else step
        counts = []
        for k in range(4):
            before = aiacc.summary()
            run(*batch(k, True))
            after = aiacc.summary()
            counts.append((after["allreduce_requests"] - before["allreduce_requests"],
                           after["allgather"] - before["allgather"]))
        assert counts[0][0] > 0, f"{how}: no check of the tables in the first step: {counts}"
        assert all(c == (0, 2) for c in counts[1:]), f"{how}: (allreduces, allgathers) per step: {counts}"
        checks.count += 1

if "shapes" in scenarios:  # a genuine mismatch: an error on every rank naming the variable, the shapes and the ranks
    for k, (how, mine_shape, theirs) in enumerate((("eager", (6, 2), (7, 2)), ("function", (6, 2), (7, 2)),
                                                   ("eager", (6, 2), (6, 3)))):
        shape = theirs if r == 1 else mine_shape
        var = tf.Variable(tf.ones(shape), name="table")
        ids = tf.constant([1, 2, 2]) if r == 0 else tf.constant([0, shape[0] - 1])

        def grad():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.gather(var, ids))
            tape = hvd.DistributedGradientTape(tape, name=f"sparse_only.shapes.{k}")
            return tape.gradient(loss, [var])

        run = tf.function(grad) if how == "function" else grad
        raises((hvd.TensorMismatchError, tf.errors.OpError), run, f"sparse_only.shapes.{k}.0.table",
               str(mine_shape), str(theirs), "rank 1")
        checks.count += 1

say(f"OK rank={r} checks={checks.count}")
hvd.shutdown()
