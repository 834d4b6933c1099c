"""Gradients that every rank had in earlier steps and that are None on one rank only in a later step, of the two
kinds that travel otherwise than a None one: an embedding's (a tf.IndexedSlices) and one of another dtype than its
variable (cast by the user). TensorFlow / Keras 3 on the TensorFlow backend, each against one process on the whole
global batch whose loss has the term on rank 0's rows only (Adam). An embedding (rank 1 looked nothing up):

- ``tape-eager``: DistributedGradientTape eagerly: the embedding on every rank, on rank 0 only, on every rank, on
  no rank (None everywhere: Adam leaves it and its moments alone, as one process), on rank 0 only, on every rank;
  rank 1 gets the same IndexedSlices average as rank 0 in the steps it had none;
- ``keras-opt``: the same phases in a custom loop with Keras' DistributedOptimizer (apply_gradients);
- ``tape-function``: in tf.function (None-ness fixed when each rank traces): the embedding on every rank and on
  none (None everywhere stays None) equal one process; then on rank 0 only: an error on rank 1 naming the
  embedding and the rank (it would skip the update rank 0 applies), while rank 0 applies the average.

- ``keras-cast``: Keras' DistributedOptimizer in a custom loop given float16 gradients of float32 variables (the
  user casts them to halve the bytes), a layer called on every rank, on rank 0 only, on none, on rank 0 only, on
  every rank: equal to one process that casts its gradients alike (to float16 rounding; the ranks bit-equal).

- ``late-eager`` / ``late-keras``: the embedding looked up by no rank in the first step (its None went in a dense
  bucket), then on rank 0 only, ...; ``late-all``: then on every rank; ``late-function``: in tf.function, traced
  without it, then on every rank, then on rank 0 only (rank 1's error naming it); ``first-eager`` /
  ``first-keras`` / ``first-function``: the embedding on rank 0 only in the first step (before: an error on every
  rank). Each against one process.

Before, the step with the embedding (or the cast layer) on rank 0 only waited (rank 1 set new buckets up, rank 0 sent
its old ones and the embedding's allgathers) until the stall inspector ended the job. Usage: tf_presence_later.py
[scenario ...] (default: all).
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
from tf_models import embedding_dense  # noqa: E402

warnings.filterwarnings("ignore", message="Gradients do not exist")  # Keras' warning for the skipped embedding
hvd.init()
r, n = hvd.rank(), hvd.size()
PART = 4
B = PART * n
PHASES = ["all", "one", "all", "none", "one", "all"]  # per step: who looks up the embedding
rng = np.random.default_rng(0)
X = rng.normal(size=(len(PHASES), B, 3)).astype(np.float32)
IDS = rng.integers(0, 6, size=(len(PHASES), B, 2)).astype(np.int32)
Y = rng.normal(size=(len(PHASES), B, 1)).astype(np.float32)
mine = slice(r * PART, (r + 1) * PART)
scenarios = sys.argv[1:] or ["tape-eager", "keras-opt", "tape-function", "keras-cast", "late-eager", "late-all",
                                "late-function", "late-keras", "first-eager", "first-keras",
                                "first-function"]
checks = Checks()


def output(emb, dense, x, ids, phase, dist):
    """The model: dense(x) plus the sum of the looked-up rows; ``phase``: who looks up (one process: the term on
    rank 0's rows only, the rows rank 0 looked up)."""
    out = dense(x)
    if phase == "none" or (dist and phase == "one" and r != 0):
        return out
    if not dist and phase == "one":
        term = tf.reduce_sum(emb(ids[:PART]), axis=[1, 2])[:, None]
        return out + tf.concat([term, tf.zeros([B - PART, 1])], 0)
    return out + tf.reduce_sum(emb(ids), axis=[1, 2])[:, None]


def batch(k, dist):
    rows = mine if dist else slice(None)
    return tf.constant(X[k][rows]), tf.constant(IDS[k][rows]), tf.constant(Y[k][rows])


def loop(dist, how, phases=PHASES, tag=""):
    emb, dense = embedding_dense()
    opt = keras.optimizers.Adam(0.05)
    if dist and how == "keras-opt":
        opt = hvd_keras.DistributedOptimizer(opt, name=f"sparse_presence.opt{tag}")
    every = emb.trainable_variables + dense.trainable_variables

    def step(x, ids, y, phase):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((output(emb, dense, x, ids, phase, dist) - y) ** 2)
        if dist and how != "keras-opt":
            tape = hvd.DistributedGradientTape(tape, name=f"sparse_presence.{how}{tag}")
        grads = tape.gradient(loss, every)
        if how == "tape-eager" and dist:  # what every rank got: the average of the slices, or None from no rank
            assert (grads[0] is None) == (phase == "none"), (phase, grads[0])
            if grads[0] is not None:
                assert isinstance(grads[0], tf.IndexedSlices), type(grads[0])
                everyone = hvd.allgather_object((grads[0].indices.numpy().tolist(), grads[0].values.numpy().tolist()))
                assert everyone[r] == everyone[0], f"rank {r}: another embedding gradient than rank 0's ({phase})"
        opt.apply_gradients(zip(grads, every))

    fn = tf.function(step) if how == "tape-function" else step  # (phase: a Python argument, one trace for each)
    for k, phase in enumerate(phases):
        fn(*batch(k, dist), phase)
    if how == "tape-function" and dist:  # the embedding on rank 0 only, in a function: rank 1 traced it None
        done = [v.numpy().copy() for v in every]
        lonely = lambda: fn(*batch(len(phases), dist), "one")  # noqa: E731
        if r == 1:
            raises((hvd.TensorMismatchError, tf.errors.OpError), lonely,
                   "is None on this rank (rank 1) in this tf.function", "embeddings")
        else:
            lonely()
        return done, every
    return every


if "tape-eager" in scenarios:
    checks.close("tape eager", loop(False, "tape-eager"), loop(True, "tape-eager"))
if "keras-opt" in scenarios:
    checks.close("keras DistributedOptimizer", loop(False, "keras-opt"), loop(True, "keras-opt"))
if "tape-function" in scenarios:
    traced = ["all", "none", "all", "all"]
    done, after = loop(True, "tape-function", traced)
    checks.close("tape tf.function", loop(False, "tape-function", traced), done)
    if r == 0:  # rank 0 applied the average of its slices and rank 1's nothing
        checks.close("tape tf.function, the embedding on rank 0 only (rank 0)",
                     loop(False, "tape-function", traced + ["one"]), after)
    else:
        checks.count += 1

# the embedding looked up by no rank in the first step (its None went in a dense bucket), then by rank 0 only, by
# every rank, ...: the same as one process, and every rank gets the same IndexedSlices average (tape-eager's asserts)
LATE = ["none", "one", "all", "one", "none", "all"]
if "late-eager" in scenarios:
    checks.close("tape eager, no embedding in the first step", loop(False, "tape-eager", LATE),
                 loop(True, "tape-eager", LATE, ".late"))
if "late-all" in scenarios:  # (on every rank in the second step: it leaves its bucket on every rank)
    checks.close("tape eager, no embedding in the first step, then on every rank",
                 loop(False, "tape-eager", ["none", "all", "one", "all"]),
                 loop(True, "tape-eager", ["none", "all", "one", "all"], ".late-all"))
if "late-function" in scenarios:  # in tf.function: traced without the embedding first, then with it on every rank
    traced = ["none", "all", "none", "all"]
    done, _ = loop(True, "tape-function", traced, ".late")
    checks.close("tape tf.function, no embedding in the first step", loop(False, "tape-function", traced), done)
    done, after = loop(True, "tape-function", ["none"], ".late-one")  # then on rank 0 only: rank 1's error
    if r == 0:
        checks.close("tape tf.function, no embedding in the first step, then on rank 0 only (rank 0)",
                     loop(False, "tape-function", ["none", "one"]), after)
    else:
        checks.count += 1
FIRST = ["one", "all", "one", "none", "all"]  # the embedding on rank 0 only in the first step
if "first-eager" in scenarios:
    checks.close("tape eager, the embedding on rank 0 only in the first step", loop(False, "tape-eager", FIRST),
                 loop(True, "tape-eager", FIRST, ".first"))
if "first-keras" in scenarios:
    checks.close("keras DistributedOptimizer, the embedding on rank 0 only in the first step",
                 loop(False, "keras-opt", FIRST), loop(True, "keras-opt", FIRST, ".first"))
if "first-function" in scenarios:  # in tf.function: rank 1 traced it None: its error, rank 0 applies the average
    done, after = loop(True, "tape-function", [], ".first-one")
    if r == 0:
        checks.close("tape tf.function, the embedding on rank 0 only in the first step (rank 0)",
                     loop(False, "tape-function", ["one"]), after)
    else:
        checks.count += 1
if "late-keras" in scenarios:
    checks.close("keras DistributedOptimizer, no embedding in the first step", loop(False, "keras-opt", LATE),
                 loop(True, "keras-opt", LATE, ".late"))


def cast_loop(dist, phases=("all", "one", "none", "one", "all")):
    """Keras' optimizer given float16 gradients of float32 variables; layer c called by ``phase``'s ranks."""
    keras.utils.set_random_seed(1)
    a, b, c = keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1), keras.layers.Dense(1)
    for layer, width in ((a, 3), (b, 4), (c, 4)):
        layer.build((None, width))
    every = a.trainable_variables + b.trainable_variables + c.trainable_variables
    opt = keras.optimizers.Adam(0.05)
    opt = hvd_keras.DistributedOptimizer(opt, name="presence_later.cast") if dist else opt
    row0 = tf.constant((np.arange(B)[:, None] < PART).astype(np.float32))
    for k, phase in enumerate(phases):
        x, _, y = batch(k, dist)
        with tf.GradientTape() as tape:
            h = a(x)
            out = b(h)
            if phase == "all" or (phase == "one" and (not dist or r == 0)):
                out = out + (c(h) * row0 if phase == "one" and not dist else c(h))
            loss = tf.reduce_mean((out - y) ** 2)
        grads = [None if g is None else tf.cast(g, tf.float16) for g in tape.gradient(loss, every)]
        opt.apply_gradients(zip(grads, every))
    return [v.numpy() for v in every]


if "keras-cast" in scenarios:
    got, want = cast_loop(True), cast_loop(False)
    for g, w in zip(got, want):  # (float16 sums of the ranks' halves against the whole batch's float16 gradient)
        assert np.allclose(g, w, rtol=1e-3, atol=5e-4), f"keras-cast: differs by {np.max(np.abs(g - w))}"
    everyone = hvd.allgather_object([g.tolist() for g in got])
    assert everyone[r] == everyone[0], f"keras-cast: rank {r}'s variables differ from rank 0's"
    checks.count += 1

say(f"OK rank={r} checks={checks.count}")
hvd.shutdown()
