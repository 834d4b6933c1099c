"""A gradient dense on some ranks and IndexedSlices on others in the FIRST step of a reduction (tf_kinds.py covers
later steps). TensorFlow / Keras 3 on the TensorFlow backend, 2 or 3 ranks, each against one process on the whole
global batch (Adam and SGD): an embedding table looked up sparsely (``tf.gather``: IndexedSlices) on some ranks'
batches and densely (``one_hot @ table``: a dense gradient) or not at all on others, from the first step on.

- ``eager-adam`` / ``eager-sgd``: DistributedGradientTape eagerly, the kinds changing per step (every rank gets the
  same gradient of the table); ``keras``: Keras' DistributedOptimizer in a custom loop;
- ``function``: the tape in tf.function, one kind per rank for every step (one trace);
- ``fit-adam`` / ``fit-sgd``: model.fit of a model whose call() looks the table up as its rank does;
- ``mismatch`` (last: it leaves the sparse rank's allgathers unanswered): a table of another shape on one rank, dense
  there and IndexedSlices on the others: an error on every rank naming it, its shapes and the ranks.

Before, each first step was an error on every rank ("in the first step of a reduction every rank must compute the
same kinds of gradients ..."). Usage: tf_kinds_first.py [scenario ...] (default: all).
"""

import sys

import numpy as np
import tensorflow as tf

tf.get_logger().setLevel("ERROR")

import keras  # noqa: E402

import aiacc.tensorflow as hvd  # noqa: E402
import aiacc.tensorflow.keras as hvd_keras  # noqa: E402
from one_process import Checks  # noqa: E402
from report import raises, say  # noqa: E402
from tf_models import embedding_dense, kinds_output  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
PART = 4
B = PART * n
# per step, rank k's kind of the table's gradient: d (dense), s (IndexedSlices), - (None); mixed from the first step
KINDS = {2: ["sd", "ds", "ss", "sd", "dd", "ds"], 3: ["sd-", "dsd", "-ss", "sds", "ddd", "s-d"]}[n]
FIXED = {2: "sd", 3: "dsd"}[n]  # one kind per rank for every step (tf.function, fit: fixed when traced)
STEPS = len(KINDS)
rng = np.random.default_rng(0)
X = rng.normal(size=(STEPS, B, 3)).astype(np.float32)
IDS = rng.integers(0, 6, size=(STEPS, B, 2)).astype(np.int32)
Y = rng.normal(size=(STEPS, B, 1)).astype(np.float32)
mine = slice(r * PART, (r + 1) * PART)
scenarios = sys.argv[1:] or ["eager-adam", "eager-sgd", "keras", "function", "fit-adam", "fit-sgd", "mismatch"]
checks = Checks()
OPTIMIZERS = {"adam": lambda: keras.optimizers.Adam(0.05), "sgd": lambda: keras.optimizers.SGD(0.1)}


def output(emb, dense, x, ids, kinds, dist):
    return kinds_output(emb, dense, x, ids, kinds, dist, r, PART)


def batch(k, dist):
    rows = mine if dist else slice(None)
    return tf.constant(X[k][rows]), tf.constant(IDS[k][rows]), tf.constant(Y[k][rows])


def loop(dist, how, kinds, opt_name, tag):
    emb, dense = embedding_dense()
    opt = OPTIMIZERS[opt_name]()
    if dist and how == "keras":
        opt = hvd_keras.DistributedOptimizer(opt, name=f"first.opt.{tag}")
    every = emb.trainable_variables + dense.trainable_variables

    def step(x, ids, y, kind):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((output(emb, dense, x, ids, kind, dist) - y) ** 2)
        if dist and how != "keras":
            tape = hvd.DistributedGradientTape(tape, name=f"first.{tag}")
        grads = tape.gradient(loss, every)
        if dist and how == "eager":  # every rank got the same gradient of the table
            g = grads[0]
            assert (g is None) == (set(kind) == {"-"}), (kind, g)
            if g is not None:
                everyone = hvd.allgather_object(tf.convert_to_tensor(g).numpy().tolist())
                assert everyone[r] == everyone[0], f"rank {r}: another table gradient than rank 0's ({kind})"
        opt.apply_gradients(zip(grads, every))

    run = tf.function(step) if how == "function" else step
    for k, kind in enumerate(kinds):
        run(*batch(k, dist), kind)
    return every


for opt_name in ("adam", "sgd"):
    if f"eager-{opt_name}" in scenarios:
        checks.close(f"tape eagerly, {opt_name}, mixed kinds from the first step",
                     loop(False, "eager", KINDS, opt_name, f"eager.{opt_name}"),
                     loop(True, "eager", KINDS, opt_name, f"eager.{opt_name}"))
if "keras" in scenarios:
    checks.close("keras DistributedOptimizer, mixed kinds from the first step",
                 loop(False, "keras", KINDS, "adam", "keras"), loop(True, "keras", KINDS, "adam", "keras"))
if "function" in scenarios:
    checks.close(f"tape in tf.function, kinds {FIXED} in every step", loop(False, "eager", [FIXED] * STEPS, "adam", "fn"),
                 loop(True, "function", [FIXED] * STEPS, "adam", "fn"))


class Lookup(keras.Model):
    """dense(x) plus the table's rows of the ids, looked up as this rank does (one process: each rank's rows so)."""

    def __init__(self, dist):
        super().__init__()
        self.emb, self.dense = embedding_dense()
        self.dist = dist

    def call(self, inputs):
        x, ids = inputs
        return output(self.emb, self.dense, x, ids, FIXED, self.dist)


def fit(dist, opt_name):
    model = Lookup(dist)
    opt = OPTIMIZERS[opt_name]()
    model.compile(optimizer=hvd_keras.DistributedOptimizer(opt, name=f"first.fit.{opt_name}") if dist else opt,
                  loss="mse")
    rows = mine if dist else slice(None)  # (step k's global batch is every rank's k-th batch)
    x, ids, y = (a[:, rows].reshape((-1,) + a.shape[2:]) for a in (X, IDS, Y))
    model.fit((x, ids), y, batch_size=PART if dist else B, epochs=1, shuffle=False, verbose=0)
    return model.emb.trainable_variables + model.dense.trainable_variables


for opt_name in ("adam", "sgd"):
    if f"fit-{opt_name}" in scenarios:
        checks.close(f"model.fit, {opt_name}, kinds {FIXED}", fit(False, opt_name), fit(True, opt_name))

if "mismatch" in scenarios:  # a genuine mismatch: still an error on every rank naming the variable and the ranks
    rows = 7 if r == 1 else 6
    table = tf.Variable(tf.zeros([rows, 2]), name="table")
    w = tf.Variable(tf.ones([3, 1]), name="w")
    x, ids, _ = batch(0, True)
    with tf.GradientTape() as tape:
        looked = tf.matmul(tf.one_hot(ids, rows), table) if r == 1 else tf.gather(table, ids)
        loss = tf.reduce_sum(looked) + tf.reduce_sum(tf.matmul(x, w))
    tape = hvd.DistributedGradientTape(tape, name="first.mismatch")
    raises((hvd.TensorMismatchError, tf.errors.OpError), lambda: tape.gradient(loss, [table, w]),
           "first.mismatch.0.table", "(6, 2)", "(7, 2)", "rank 1")
    checks.count += 1

say(f"OK rank={r} checks={checks.count}")
hvd.shutdown()
