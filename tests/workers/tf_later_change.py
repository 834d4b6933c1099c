"""The list of variables a reduction differentiates changes at a LATER step (a layer built, frozen or unfrozen),
TensorFlow / Keras 3 on the TensorFlow backend, 2 ranks. On every rank at once it trains as one process on the whole
global batch; on one rank only it is an error on every rank naming the ranks and the gradients.

- ``tape``: DistributedGradientTape eagerly over the variables of layers a, b; then a head c added (a, b, c), then a
  frozen (b, c), then back to (a, b), on every rank: equal to one process (SGD); once a step's change is done, a step
  sends as many allreduces as before it;
- ``function``: the same in tf.function (each change a retrace, on every rank);
- ``alternate``: a persistent tape asked for two lists in every step (a GAN's two tapes under one name): after the
  first step, every step sends the same allreduces (going back to a settled list costs nothing);
- ``fit``: model.fit with Keras' DistributedOptimizer, the first layer frozen (``trainable=False`` + compile) on every
  rank between two fits, then unfrozen: equal to one process;
- ``grow-one`` / ``shrink-one`` / ``fit-one`` / ``sparse-one``: rank 1 alone adds the head c (eagerly), freezes a in a
  tf.function (a retrace on rank 1 only), freezes a between two fits, or leaves a dense layer out beside an embedding
  (eagerly; the embedding's allgathers then go under another name on rank 1): an error on every rank saying that rank
  1 changed the gradients it averages and rank 0 did not, naming the gradients only one rank has; each rank raises it
  at once (rank 0 does not wait for its embedding's allgathers, which rank 1 sent under another name).

Before, a change on one rank waited until the stall inspector ended the job: rank 1 set new buckets up (a first-step
collective) while rank 0 sent its old ones. Usage: tf_later_change.py [scenario ...] (default: all).
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
from tf_models import embedding_dense, lookup  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
assert n == 2, "a 2-rank worker"
PART = 4
B = PART * n
PHASES = ["ab", "ab", "abc", "abc", "bc", "bc", "ab", "ab"]  # per step: the layers whose variables are differentiated
STEPS = len(PHASES)
rng = np.random.default_rng(0)
X = rng.normal(size=(STEPS, B, 5)).astype(np.float32)
Y = rng.normal(size=(STEPS, B, 1)).astype(np.float32)
IDS = rng.integers(0, 6, size=(STEPS, B, 2)).astype(np.int32)
mine = slice(r * PART, (r + 1) * PART)
scenarios = sys.argv[1:] or ["tape", "function", "alternate", "fit", "grow-one", "shrink-one", "fit-one", "sparse-one"]
checks = Checks()
ERRORS = (hvd.TensorMismatchError, tf.errors.OpError)


def layers():
    """Dense a (5 -> 4), and two heads b, c (4 -> 1), built on every rank from the same seed."""
    keras.utils.set_random_seed(1)
    a, b, c = keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1), keras.layers.Dense(1)
    a.build((None, 5))
    b.build((None, 4))
    c.build((None, 4))
    return a, b, c


def batch(k, dist):
    rows = mine if dist else slice(None)
    return tf.constant(X[k][rows]), tf.constant(Y[k][rows])


def allreduces() -> int:
    return aiacc.summary()["allreduce_requests"]


def train(dist, traced, phases, tag):
    """SGD steps over the variables of the layers named by each step's phase (``phases[k]``, or per rank in a dict);
    the head c is in the loss where it is differentiated. Returns every variable, and the allreduces per step."""
    a, b, c = layers()
    layer = {"a": a, "b": b, "c": c}
    opt = keras.optimizers.SGD(0.1)
    opt.build(a.trainable_variables + b.trainable_variables + c.trainable_variables)

    def step(x, y, phase):
        with tf.GradientTape() as tape:
            h = a(x)
            out = b(h) + c(h) if "c" in phase else b(h)
            loss = tf.reduce_mean((out - y) ** 2)
        variables = [v for name in phase for v in layer[name].trainable_variables]
        if dist:
            tape = hvd.DistributedGradientTape(tape, name=f"later.{tag}")
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))

    run = tf.function(step) if traced else step
    counts = []
    for k, phase in enumerate(phases):
        before = allreduces()
        run(*batch(k, dist), phase[r] if isinstance(phase, dict) else phase)
        counts.append(allreduces() - before)
    return a.trainable_variables + b.trainable_variables + c.trainable_variables, counts


def same_list(traced, tag):
    ref, _ = train(False, traced, PHASES, tag)
    got, counts = train(True, traced, PHASES, tag)
    checks.close(f"{tag}: the variables changed on every rank at once", ref, got)
    # after each change's step (which settles the new buckets) a step sends what a step sent before the change
    steady = [counts[k] for k in range(1, STEPS) if PHASES[k] == PHASES[k - 1]]
    assert len(set(steady)) == 1, f"{tag}: allreduces per step {counts}"


if "tape" in scenarios:
    same_list(False, "tape")
if "function" in scenarios:
    same_list(True, "function")

if "alternate" in scenarios:  # two lists in every step under one name: settled once, then no extra collective
    a, b, c = layers()
    counts = []
    for k in range(5):
        before = allreduces()
        x, y = batch(k, True)
        with tf.GradientTape(persistent=True) as tape:
            h = a(x)
            loss = tf.reduce_mean((b(h) - y) ** 2) + tf.reduce_mean((c(h) - y) ** 2)
        tape = hvd.DistributedGradientTape(tape, name="later.alternate")
        for head in (b, c):
            grads = tape.gradient(loss, a.trainable_variables + head.trainable_variables)
            assert all(g is not None for g in grads)
        counts.append(allreduces() - before)
    assert counts[0] > counts[1] and len(set(counts[1:])) == 1, f"alternate: allreduces per step {counts}"
    checks.count += 1


def fit(dist, frozen_on, tag, back=True):
    """model.fit, then the first layer frozen on the ranks ``frozen_on`` (one process: frozen) and fit again, then
    unfrozen and fit again (``back``). Returns the model's weights."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.1)
    if dist:
        opt = hvd_keras.DistributedOptimizer(opt, name=f"later.{tag}")
    model.compile(optimizer=opt, loss="mse")
    x, y = (np.concatenate(list(a[:3, mine if dist else slice(None)])) for a in (X, Y))  # (3 steps per epoch)
    kwargs = dict(batch_size=PART if dist else B, epochs=1, shuffle=False, verbose=0)
    model.fit(x, y, **kwargs)
    model.layers[0].trainable = not (not dist or r in frozen_on)
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, **kwargs)
    if back:
        model.layers[0].trainable = True
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, **kwargs)
    return model.weights


if "fit" in scenarios:
    checks.close("model.fit, a layer frozen and unfrozen on every rank between fits", fit(False, (0, 1), "fit"),
                 fit(True, (0, 1), "fit"))

# one rank alone: an error on every rank naming the ranks and the gradients (never a wait for the stall inspector)
ALONE = "rank 1 changed the gradients it averages between steps and rank 0 did not"
if "grow-one" in scenarios:  # a head added on rank 1 only, eagerly: only rank 1 has its gradients
    raises(ERRORS, lambda: train(True, False, ["ab", "ab", {0: "ab", 1: "abc"}], "grow"), ALONE,
           "only rank 1 has 'later.grow.4.kernel', 'later.grow.5.bias'", "DistributedGradientTape 'later.grow'")
    checks.count += 1
if "shrink-one" in scenarios:  # a frozen on rank 1 only, in tf.function (rank 1 retraces alone)
    raises(ERRORS, lambda: train(True, True, ["ab", "ab", {0: "ab", 1: "b"}], "shrink"), ALONE,
           "only rank 0 has 'later.shrink.2.kernel', 'later.shrink.3.bias'")
    checks.count += 1
if "fit-one" in scenarios:  # the first layer frozen on rank 1 only between two fits
    raises(ERRORS, lambda: fit(True, (1,), "fit_one", back=False), ALONE, "DistributedOptimizer 'later.fit_one'")
    checks.count += 1
if "sparse-one" in scenarios:  # (last: the embedding's allgathers of the failed step stay unmatched)
    emb, dense = embedding_dense()

    def sparse_step(k, variables):
        x = tf.constant(X[k][mine][:, :3])
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((dense(x) + lookup(emb, tf.constant(IDS[k][mine]), "s") - Y[k][mine]) ** 2)
        tape = hvd.DistributedGradientTape(tape, name="later.sparse")
        return tape.gradient(loss, variables)

    every = dense.trainable_variables + emb.trainable_variables
    for k in range(2):
        sparse_step(k, every)
    raises(ERRORS, lambda: sparse_step(2, emb.trainable_variables if r == 1 else every), ALONE,
           "'later.sparse.0.embeddings'")
    # each rank got its error by itself: rank 0 did not wait for its embedding's allgathers, which rank 1 sends under
    # another name (before: until rank 1 shut down), so the ranks meet again here
    assert hvd.allgather_object(r) == [0, 1]
    checks.count += 1

say(f"OK rank={r} checks={checks.count}")
hvd.shutdown()
