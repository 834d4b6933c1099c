"""Keras 3's ``model.compile(..., steps_per_execution=N)`` (N train steps in one compiled call) with aiacc.keras'
``DistributedOptimizer``, 2 or more ranks, on the backend ``KERAS_BACKEND`` names (tensorflow, jax or torch).

* TensorFlow and JAX: ``fit`` with N=4 (SGD with momentum, ``BroadcastGlobalVariablesCallback(0)`` and
  ``MetricAverageCallback``, every rank from its own random weights, each on its share of every global batch)
  equals plain Keras with the same N trained from rank 0's weights on the whole batches; every rank ends with the
  same weights and logs the same loss. The engine reduces once per step (8 per epoch), not once per call of the
  compiled function (2 per epoch).
* Adam with N=3 on 7 batches an epoch (a shorter last call) equals plain Keras with N=3.
* ``backward_passes_per_step=2`` with N=3 (updates that straddle the calls, an odd micro-batch left over at the
  epoch's end) equals plain Keras SGD(2·lr) with Keras' accumulation on the whole batches; one reduction per
  update.
* The batch-level learning-rate callbacks (``LearningRateWarmupCallback``, a per-batch
  ``LearningRateScheduleCallback``) with N=3: Keras calls them at batches 0, 3, 6 only; the rate they set there is the
  schedule's at that batch, and rank 0 logs one warning per callback saying the rate changes once per 3 steps and
  naming ``LearningRateSchedule`` (none with N=1, none for a staircase schedule: set at each epoch's first batch).
  Before, nothing said so.
* PyTorch: Keras itself refuses N > 1 when ``fit`` starts, before any step, with an error naming
  ``steps_per_execution`` (on every rank: no hang).
"""

import logging
import os

import numpy as np

BACKEND = os.environ.get("KERAS_BACKEND", "tensorflow")
if BACKEND == "tensorflow":
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.get_logger().setLevel("ERROR")
elif BACKEND == "torch":
    import torch

    torch.set_num_threads(1)

import keras  # noqa: E402

import aiacc  # noqa: E402
import aiacc.keras as hvd  # noqa: E402
from report import raises, say  # noqa: E402

assert keras.backend.backend() == BACKEND, keras.backend.backend()
hvd.init()
r, n = hvd.rank(), hvd.size()
engine = aiacc.get_engine()
checks = 0
# on TensorFlow a wrapped optimizer's first update agrees with the other ranks on its gradients: two more, once
SETUP = 2 if BACKEND == "tensorflow" else 0


def requests() -> int:
    """Allreduces asked of the engine so far (one per bucket of gradients)."""
    return engine.stats.get("allreduce_requests", 0)


def model_of(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(2)])


def weights(model):
    return [keras.ops.convert_to_numpy(w) for w in model.trainable_weights]


BATCH = 8  # per rank: each global batch of 8 * n rows is split in n shares, one per rank
rng = np.random.default_rng(11)
features = rng.normal(size=(8 * BATCH * n, 4)).astype(np.float32)
targets = rng.normal(size=(8 * BATCH * n, 2)).astype(np.float32)


def data(batches):
    """This rank's rows of the first ``batches`` global batches, and those batches whole."""
    mine = np.concatenate([np.arange(BATCH * (n * b + r), BATCH * (n * b + r + 1)) for b in range(batches)])
    rows = slice(0, batches * BATCH * n)
    return features[mine], targets[mine], features[rows], targets[rows]


if BACKEND == "torch":
    model = model_of(5)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", steps_per_execution=4)
    x, y, _, _ = data(8)
    raises(ValueError, lambda: model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                                         callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)]),
           "steps_per_execution", "PyTorch")
    checks += 1
    say(f"OK rank={r} checks={checks}")
    raise SystemExit(0)


class Logged(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def on_train_batch_end(self, batch, logs=None):
        self.calls += 1

    def on_epoch_end(self, epoch, logs=None):
        self.loss = logs["loss"]


# ---- SGD with momentum and Horovod's callbacks, 4 steps per call: 2 calls, 8 reductions an epoch ---------------
x, y, gx, gy = data(8)
model = model_of(100 + r)  # different on every rank: the broadcast must make them equal
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), name="spe.sgd"),
              loss="mse", steps_per_execution=4)
logged = Logged()
before = requests()
model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(), logged])
ran = requests() - before
ref = model_of(100)  # rank 0's start
ref.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse", steps_per_execution=4)
ref.fit(gx, gy, batch_size=n * BATCH, epochs=2, shuffle=False, verbose=0)
for w, v in zip(weights(model), weights(ref)):
    assert np.allclose(w, v, rtol=1e-5, atol=1e-6), ("SGD, steps_per_execution=4", np.abs(w - v).max())
checks += 1
assert logged.calls == 4, f"{logged.calls} calls of the compiled function for 16 steps of 4"
assert ran == 16 + SETUP, f"steps_per_execution=4: {ran} reductions for 16 steps (4 calls)"
checks += 1
everyone = hvd.allgather_object((weights(model), logged.loss))
for k, (ws, loss) in enumerate(everyone):
    assert all(np.array_equal(a, b) for a, b in zip(ws, everyone[0][0])), f"rank {k}'s weights differ from rank 0's"
    assert loss == everyone[0][1], f"rank {k} logged loss {loss}, rank 0 {everyone[0][1]}"
checks += 1

# ---- Adam, 3 steps per call on 7 batches an epoch (calls of 3, 3 and 1 steps) ------------------------------------
x, y, gx, gy = data(7)
model = model_of(6)
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), name="spe.adam"), loss="mse",
              steps_per_execution=3)
before = requests()
model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
ran = requests() - before
ref = model_of(6)
ref.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", steps_per_execution=3)
ref.fit(gx, gy, batch_size=n * BATCH, epochs=2, shuffle=False, verbose=0)
for w, v in zip(weights(model), weights(ref)):
    assert np.allclose(w, v, rtol=1e-5, atol=1e-6), ("Adam, steps_per_execution=3", np.abs(w - v).max())
assert ran == 14 + SETUP, f"steps_per_execution=3: {ran} reductions for 14 steps (6 calls)"
checks += 2

# ---- backward_passes_per_step=2, 3 steps per call: updates straddle the calls; 7 updates in 14 micro-batches -----
model = model_of(7)
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), backward_passes_per_step=2,
                                                 name="spe.passes"), loss="mse", steps_per_execution=3)
before = requests()
model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
ran = requests() - before
ref = model_of(7)
ref.compile(optimizer=keras.optimizers.SGD(0.2, momentum=0.9, gradient_accumulation_steps=2), loss="mse",
            steps_per_execution=3)
ref.fit(gx, gy, batch_size=n * BATCH, epochs=2, shuffle=False, verbose=0)
for w, v in zip(weights(model), weights(ref)):
    assert np.allclose(w, v, rtol=1e-5, atol=1e-6), ("backward_passes_per_step=2", np.abs(w - v).max())
assert ran == 7 + SETUP, f"backward_passes_per_step=2, steps_per_execution=3: {ran} reductions for 7 updates"
checks += 2

# ---- batch-level learning-rate callbacks: Keras calls them once per call of N steps; a warning says so ------------
class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.texts = []

    def emit(self, record):
        self.texts.append(record.getMessage())


class Rates(keras.callbacks.Callback):
    """(after the learning-rate callbacks) the batch index of each hook and the rate set there."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_begin(self, batch, logs=None):
        self.seen.append((batch, float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))))


caught = Warnings()
hvd.callbacks.logger.addHandler(caught)
x, y, _, _ = data(8)
for steps in (3, 1):
    model = model_of(8)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), name=f"spe.lr.{steps}"), loss="mse",
                  steps_per_execution=steps)
    warmup = hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=2)
    stairs = hvd.callbacks.LearningRateScheduleCallback(0.1, 0.5, start_epoch=2)
    smooth = hvd.callbacks.LearningRateScheduleCallback(0.1, 0.5, start_epoch=3, staircase=False)
    rates = Rates()
    caught.texts.clear()
    model.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0, callbacks=[warmup, stairs, smooth, rates])
    hooks = list(range(0, 8, steps))  # (each epoch's)
    assert [b for b, _ in rates.seen] == hooks * 4, (steps, rates.seen)
    for k, (b, lr) in enumerate(rates.seen):
        epoch = k // len(hooks)
        want = {0: warmup.learning_rate_at(0, b), 1: warmup.learning_rate_at(1, b), 2: 0.1,
                3: 0.1 * 0.5 ** (b / 8)}[epoch]  # (the smooth schedule's rate at that batch of epoch 3)
        assert np.isclose(lr, want, rtol=1e-6), (steps, epoch, b, lr, want)
    about = [t for t in caught.texts if "steps_per_execution" in t]
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[warmup])  # (again: no warning)
    assert [t for t in caught.texts if "steps_per_execution" in t] == about, caught.texts
    if steps > 1 and r == 0:
        assert len(about) == 2, about  # (warmup and the smooth schedule; not the staircase one)
        for t, who in zip(about, ("LearningRateWarmupCallback", "LearningRateScheduleCallback")):
            for word in (who, "once per 3 steps", "LearningRateSchedule ", "steps_per_execution=1"):
                assert word in t, (word, t)
    else:
        assert not about, (steps, about)
    checks += 1
hvd.callbacks.logger.removeHandler(caught)

say(f"OK rank={r} checks={checks}")
