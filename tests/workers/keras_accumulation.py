"""Gradient accumulation in Keras' DistributedOptimizer, on 2 or more ranks: Horovod's ``backward_passes_per_step``
and Keras' own ``gradient_accumulation_steps``.

* ``apply`` once per micro-batch, eagerly and in tf.function: the variables change only every N-th call,
  then by the average across ranks of the micro-batches' sum (``average_aggregated_gradients=True``: their
  mean), against a reference computed here from every rank's gradients (each rank knows them all).
* The engine reduces once per update step, not once per micro-batch (a count of its allreduces, besides the
  two of the first update's agreement on the gradients).
* ``model.fit`` with ``backward_passes_per_step=2`` on a share of every batch per rank equals plain Keras SGD
  (twice the learning rate: the sum of two micro-batches) with Keras' accumulation on the whole batches;
  an optimizer given with Keras' own ``gradient_accumulation_steps=2`` equals it at the same learning rate,
  and so do both given with ``average_aggregated_gradients=True``; saved and loaded by
  ``hvd.load_model(..., backward_passes_per_step=2)`` the first goes on summing.
* Bad combinations are errors that name the arguments; so are float8 training's variables.
"""

import os
import tempfile

import numpy as np
import tensorflow as tf

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.get_logger().setLevel("ERROR")

import keras  # noqa: E402

import aiacc  # noqa: E402
import aiacc.keras as hvd  # noqa: E402
from report import raises, say  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
engine = aiacc.get_engine()
checks = 0


# a wrapped optimizer's first update agrees with the other ranks on its gradients: two small allreduces, once
SETUP = 2


def reductions() -> int:
    """Collectives the engine has run so far: through MPI and through the host's shared window."""
    shared = engine.executor.shared
    return engine.stats["allreduces"] + (shared.reductions if shared is not None else 0)


def grad(k, s):
    """Rank k's gradient in micro-batch s."""
    return np.array([1.0 + k + s, 2.0 * s - k, 0.5 * k * s], np.float32)


# ---- apply per micro-batch: updates every N-th call, by the sum (or mean) averaged across ranks ---------
N, STEPS, LR = 2, 6, 0.5
for mode, wrap in (("eager", lambda f: f), ("function", tf.function)):
    for mean in (False, True):
        x = tf.Variable(np.zeros(3, np.float32))
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(LR), backward_passes_per_step=N,
                                       average_aggregated_gradients=mean, name=f"acc.{mode}.{mean}")
        step = wrap(lambda g: opt.apply([g], [x]))
        want = np.zeros(3)
        before = reductions()
        for s in range(STEPS):
            step(tf.constant(grad(r, s)))
            if s % N == N - 1:  # the update: the ranks' average of the sum of the last N micro-batches
                total = np.mean([sum(grad(k, t) for t in range(s - N + 1, s + 1)) for k in range(n)], axis=0)
                want = want - LR * (total / N if mean else total)
            assert np.allclose(x.numpy(), want, rtol=1e-6, atol=1e-6), (mode, mean, s, x.numpy(), want)
        ran = reductions() - before
        assert ran == STEPS // N + SETUP, f"{mode} mean={mean}: {ran} reductions for {STEPS // N} updates"
        checks += 2

# ---- model.fit: equal to plain Keras on the whole batches ------------------------------------------------
rng = np.random.default_rng(7)
BATCH = 8  # per rank: each global batch of 8 * n rows is split in n shares, one per rank
features = rng.normal(size=(4 * BATCH * n, 4)).astype(np.float32)  # 4 global batches
targets = rng.normal(size=(4 * BATCH * n, 2)).astype(np.float32)


def model_of():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(2)])
    return model


def fit(model, optimizer, x, y, batch):
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    return [w.numpy() for w in model.trainable_weights]


# rank r trains on its share of every global batch b (rows 8nb + 8r .. 8nb + 8r + 7)
mine = np.concatenate([np.arange(BATCH * (n * b + r), BATCH * (n * b + r + 1)) for b in range(4)])
for how, make, lr_ref in (
        ("backward_passes_per_step=2", lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                                         backward_passes_per_step=2,
                                                                         name="fit.passes"), 0.2),
        ("Keras' gradient_accumulation_steps=2", lambda: hvd.DistributedOptimizer(
            keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), name="fit.keras"), 0.1),
        ("both, with average_aggregated_gradients=True", lambda: hvd.DistributedOptimizer(
            keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), backward_passes_per_step=2,
            average_aggregated_gradients=True, name="fit.both"), 0.1)):
    before = reductions()
    model = model_of()
    got = fit(model, make(), features[mine], targets[mine], BATCH)
    ran = reductions() - before
    ref_model = model_of()
    ref = fit(ref_model, keras.optimizers.SGD(lr_ref, gradient_accumulation_steps=2), features, targets, n * BATCH)
    for w, v in zip(got, ref):
        assert np.allclose(w, v, rtol=1e-5, atol=1e-6), (how, np.abs(w - v).max())
    assert ran == 2 + SETUP, f"{how}: {ran} reductions for 4 micro-batches (2 updates, one bucket each)"
    checks += 2
    if how.startswith("backward_passes_per_step"):
        # the file records Keras' accumulation steps only: hvd.load_model(..., backward_passes_per_step=2) resumes
        # with Horovod's sum (Keras' mean would halve every update)
        with tempfile.TemporaryDirectory() as tmp:  # (removed again: runs leave nothing in /tmp)
            path = os.path.join(tmp, f"passes{r}.keras")
            model.save(path)
            loaded = hvd.load_model(path, backward_passes_per_step=2)
        loaded.fit(features[mine], targets[mine], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        ref_model.fit(features, targets, batch_size=n * BATCH, epochs=1, shuffle=False, verbose=0)
        for w, v in zip(loaded.trainable_weights, ref_model.trainable_weights):
            assert np.allclose(w.numpy(), v.numpy(), rtol=1e-5, atol=1e-6), ("resumed", np.abs(w - v).max())
        checks += 1

# ---- errors ----------------------------------------------------------------------------------------------
raises(ValueError, lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, gradient_accumulation_steps=3),
                                                    backward_passes_per_step=2),
       "backward_passes_per_step=2", "gradient_accumulation_steps=3")
# the same count, different rules (Horovod's sum, Keras' mean): refused, before Horovod's sum won silently
raises(ValueError, lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2),
                                                    backward_passes_per_step=2),
       "Horovod's rule", "Keras' rule", "gradient_accumulation_steps=2")
raises(ValueError, lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=0),
       "backward_passes_per_step=0", ">= 1")
if n & (n - 1) == 0:
    raises(ValueError, lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Adasum,
                                                        backward_passes_per_step=2, average_aggregated_gradients=True),
           "Adasum", "average_aggregated_gradients=True")
else:  # Adasum runs on a power-of-2 number of ranks: that error comes first
    raises(NotImplementedError, lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Adasum),
           "Adasum runs on a power-of-2 number of ranks", f"not {n}")
# float8 training's variables take their gradient as their value (overwrite_with_gradient): refused, as aiacc
# would average what is a maximum (and the ranks drifted apart under accumulation)
fp8 = model_of()
fp8.quantize("float8")
fp8.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), name="fit.fp8"), loss="mse")
raises(NotImplementedError, lambda: fp8.fit(features[mine], targets[mine], batch_size=BATCH, verbose=0),
       "inputs_amax_history", "float8")
checks += 5

say(f"OK rank={r} checks={checks}")
