"""A gradient whose kind or dtype differs across ranks, or changes on some ranks only in a later step.
TensorFlow / Keras 3 on the TensorFlow backend, each against one process on the whole global batch (Adam):

- ``kinds-eager`` / ``kinds-keras``: an embedding table looked up densely (``one_hot @ table``: a dense gradient) or
  sparsely (``tf.gather``: ``tf.IndexedSlices``) or not at all, per rank and per step: dense on every rank first (in
  its bucket), then sparse on rank 0 and dense on rank 1, sparse on both, dense on rank 0 and sparse on rank 1, ...
  (DistributedGradientTape eagerly; Keras' DistributedOptimizer in a custom loop). Every rank gets the same
  gradient. ``kinds-function``: the same in tf.function (a trace per step's pair of kinds, reused in later steps,
  after the table left its bucket);
- ``cast-first``: Keras' DistributedOptimizer given float16 gradients of float32 variables (the user casts them), a
  layer called on rank 0 only in the first step (None on rank 1), then on every rank, on none, ...;
  ``cast-first-function``: in tf.function, where rank 1 traced it None: its error naming it, rank 0 applies the
  average, and the next steps (no rank, every rank) run;
- ``cast-later``: float32 gradients, then rank 0 alone casts them to float16 (a new dtype on one rank only), then
  both ranks, then rank 1 alone; the ranks stay bit-equal.

Before, a kind that changed on one rank was a TypeError on the dense rank ('NoneType' object is not subscriptable)
or a wait until the stall inspector (the rank whose kind or dtype changed set up new buckets alone), and cast-first
was a dtype mismatch error on every rank. Usage: tf_kinds.py [scenario ...] (default: all).
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
# per step, rank k's kind of the table's gradient: d (dense), s (IndexedSlices), - (None)
KINDS = ["dd", "sd", "ss", "ds", "dd", "-d", "s-", "--", "sd", "dd"]
rng = np.random.default_rng(0)
STEPS = 10
X = rng.normal(size=(STEPS, B, 3)).astype(np.float32)
IDS = rng.integers(0, 6, size=(STEPS, B, 2)).astype(np.int32)
Y = rng.normal(size=(STEPS, B, 1)).astype(np.float32)
mine = slice(r * PART, (r + 1) * PART)
scenarios = sys.argv[1:] or ["kinds-eager", "kinds-keras", "kinds-function", "cast-first", "cast-later",
                             "cast-first-function"]
checks = Checks()


def output(emb, dense, x, ids, kinds, dist):
    return kinds_output(emb, dense, x, ids, kinds, dist, r, PART)


def batch(k, dist):
    rows = mine if dist else slice(None)
    return tf.constant(X[k][rows]), tf.constant(IDS[k][rows]), tf.constant(Y[k][rows])


def loop(dist, how, kinds=KINDS):
    emb, dense = embedding_dense()
    opt = keras.optimizers.Adam(0.05)
    if dist and how == "keras":
        opt = hvd_keras.DistributedOptimizer(opt, name=f"kinds.opt.{how}")
    every = emb.trainable_variables + dense.trainable_variables

    def step(x, ids, y, k):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((output(emb, dense, x, ids, kinds[k], dist) - y) ** 2)
        if dist and how != "keras":
            tape = hvd.DistributedGradientTape(tape, name=f"kinds.{how}")
        grads = tape.gradient(loss, every)
        if dist and how == "eager":  # every rank got the same gradient of the table
            g = grads[0]
            assert (g is None) == (kinds[k] == "--"), (kinds[k], g)
            if g is not None:
                g = tf.convert_to_tensor(g).numpy().tolist()
                everyone = hvd.allgather_object(g)
                assert everyone[r] == everyone[0], f"rank {r}: another table gradient than rank 0's ({kinds[k]})"
        opt.apply_gradients(zip(grads, every))

    if how == "function":
        fn = tf.function(lambda x, ids, y, kind: step(x, ids, y, kinds.index(kind)))
        for k, kind in enumerate(kinds):  # (the kind of this rank: a Python argument, a trace per kind)
            fn(*batch(k, dist), kind)
    else:
        for k in range(len(kinds)):
            step(*batch(k, dist), k)
    return every


if "kinds-eager" in scenarios:
    checks.close("tape eager, the table's kinds change", loop(False, "eager"), loop(True, "eager"))
if "kinds-keras" in scenarios:
    checks.close("keras DistributedOptimizer, the table's kinds change", loop(False, "keras"), loop(True, "keras"))
# (in a graph a gradient traced None on one rank and computed on another is an error there: no "-d")
FUNCTION_KINDS = ["dd", "sd", "ss", "ds", "dd", "--", "sd", "dd"]
if "kinds-function" in scenarios:
    checks.close("tape tf.function, the table's kinds change", loop(False, "eager", FUNCTION_KINDS),
                 loop(True, "function", FUNCTION_KINDS))


def cast_loop(dist, phases, casts, tag):
    """Keras' optimizer; layer c called by ``phases[k]``'s ranks (all, one: rank 0, none); ``casts[k]``: per rank,
    whether it casts its gradients to float16 (one process: each rank's half of the gradient cast as that rank)."""
    keras.utils.set_random_seed(1)
    a, b, c = keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1), keras.layers.Dense(1)
    for layer, width in ((a, 3), (b, 4), (c, 4)):
        layer.build((None, width))
    every = a.trainable_variables + b.trainable_variables + c.trainable_variables
    opt = keras.optimizers.Adam(0.05)
    opt = hvd_keras.DistributedOptimizer(opt, name=f"kinds.cast.{tag}") if dist else opt

    def rank_grads(x, y, phase, k):
        """Rank k's gradients of the mean loss of its rows ``x``, ``y``, cast to float16 where it casts."""
        with tf.GradientTape() as tape:
            h = a(x)
            out = b(h)
            if phase == "all" or (phase == "one" and k == 0):
                out = out + c(h)
            loss = tf.reduce_mean((out - y) ** 2)
        grads = tape.gradient(loss, every)
        return [g if g is None or not casts_now[k] else tf.cast(g, tf.float16) for g in grads]

    for k, (phase, casts_now) in enumerate(zip(phases, casts)):
        x, _, y = batch(k, dist)
        if dist:
            grads = rank_grads(x, y, phase, r)
        else:  # each rank's gradients in its dtype, averaged as the reduction does (None: zeros; None everywhere)
            parts = [rank_grads(x[j * PART:(j + 1) * PART], y[j * PART:(j + 1) * PART], phase, j) for j in range(n)]
            grads = []
            for gs in zip(*parts):
                have = [tf.cast(g, tf.float32) for g in gs if g is not None]
                grads.append(None if not have else tf.add_n(have) / n)
        opt.apply_gradients(zip(grads, every))
    return [v.numpy() for v in every]


def check_cast(name, phases, casts):
    got, want = cast_loop(True, phases, casts, name), cast_loop(False, phases, casts, name)
    for g, w in zip(got, want):  # (float16 wire against float32 sums)
        assert np.allclose(g, w, rtol=1e-3, atol=5e-4), f"{name}: differs by {np.max(np.abs(g - w))}"
    everyone = hvd.allgather_object([g.tolist() for g in got])
    assert everyone[r] == everyone[0], f"{name}: rank {r}'s variables differ from rank 0's"
    checks.count += 1


if "cast-first" in scenarios:  # a cast gradient None on rank 1 in the first step
    phases = ["one", "all", "none", "one", "all"]
    check_cast("cast-first", phases, [(True, True)] * len(phases))
if "cast-later" in scenarios:  # a new dtype on one rank only in a later step
    phases = ["all", "all", "one", "all", "all", "all"]
    check_cast("cast-later", phases, [(False, False), (True, False), (True, False), (True, True), (False, True),
                                      (False, False)])



def cast_function(phases):
    """``cast_loop``'s model in tf.function, float16 gradients on every rank, layer c called by ``phases[k]``'s ranks;
    returns the variables after each step."""
    keras.utils.set_random_seed(1)
    a, b, c = keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1), keras.layers.Dense(1)
    for layer, width in ((a, 3), (b, 4), (c, 4)):
        layer.build((None, width))
    every = a.trainable_variables + b.trainable_variables + c.trainable_variables
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.Adam(0.05), name="kinds.cast.function")

    @tf.function
    def step(x, y, use_c):
        with tf.GradientTape() as tape:
            h = a(x)
            out = b(h) + c(h) if use_c else b(h)
            loss = tf.reduce_mean((out - y) ** 2)
        opt.apply_gradients(zip([None if g is None else tf.cast(g, tf.float16) for g in tape.gradient(loss, every)],
                                every))

    after = []
    for k, phase in enumerate(phases):
        x, _, y = batch(k, True)
        use_c = phase == "all" or (phase == "one" and r == 0)
        if phase == "one" and r == 1:  # traced None here, float16 on rank 0: this rank would skip rank 0's update
            raises((hvd.TensorMismatchError, tf.errors.OpError), lambda: step(x, y, use_c),
                   "is None on this rank (rank 1) in this tf.function", ".4.kernel")
        else:
            step(x, y, use_c)
        after.append([v.numpy() for v in every])
    return after


if "cast-first-function" in scenarios:  # in tf.function: rank 1 traced it None in the first step: its error there
    after = cast_function(["one", "none", "all"])  # (then no rank, then every rank: both traces of each rank run)
    if r == 0:  # rank 0 applied the average of its float16 gradient and rank 1's nothing
        want = cast_loop(False, ["one"], [(True, True)], "cast-first-function")
        for g, w in zip(after[0], want):
            assert np.allclose(g, w, rtol=1e-3, atol=5e-4), f"cast-first-function: differs by {np.max(np.abs(g - w))}"
    checks.count += 1

say(f"OK rank={r} checks={checks.count}")
hvd.shutdown()
