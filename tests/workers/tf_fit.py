"""Keras 3 model.fit with aiacc.keras: DistributedOptimizer and the three callbacks.

* Ranks build their models with different seeds, train on a share of every batch with the wrapped Adam and
  BroadcastGlobalVariablesCallback(0); every rank also trains rank 0's model (seed 0) alone on the whole
  batches with the plain Adam. After 20 steps the variables must agree within 1e-5 (relative).
* MetricAverageCallback: a recorder placed before it sees each rank's own logs (which differ, the data
  differ); the logs after it (and Keras' History) are identical on all ranks and equal the mean.
* LearningRateWarmupCallback: the learning rate seen at every batch follows Horovod's formula; it warns (rank 0)
  that momentum_correction is not applied, also through a LossScaleOptimizer.
* hvd.load_model gives the saved model back with its optimizer wrapped and its state restored; it trains on
  as the single-process reference does.
* Ranks whose fit runs different numbers of steps or epochs get an error naming each rank's from both callbacks.
* model.fit's gradients went through the gradient buckets (the embedding's IndexedSlices outside them),
  without a copy out; gradients that do not match the variables in number are an error naming them.
"""

import gc
import logging
import os
import tempfile

import numpy as np
import tensorflow as tf

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.get_logger().setLevel("ERROR")

import keras  # noqa: E402

import aiacc.keras as hvd  # noqa: E402
import aiacc.tensorflow.keras  # noqa: E402
from aiacc.tensorflow import _buckets  # noqa: E402
from report import raises, say  # noqa: E402

assert hvd is aiacc.tensorflow.keras and hvd.callbacks is aiacc.tensorflow.keras.callbacks

hvd.init()
r, n = hvd.rank(), hvd.size()
EPOCHS, STEPS, VOCAB, SEQ = 2, 10, 30, 4
part = 8  # each rank's rows of every global batch
BATCH = part * n
checks = 0

rng = np.random.default_rng(0)
X = rng.integers(0, VOCAB, size=(STEPS, BATCH, SEQ)).astype(np.int32)
Y = rng.integers(0, 3, size=(STEPS, BATCH)).astype(np.int32)
x_mine = X[:, r * part:(r + 1) * part].reshape(-1, SEQ)  # this rank's share of every batch
y_mine = Y[:, r * part:(r + 1) * part].reshape(-1)


def build(seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((SEQ,), dtype="int32"),
        keras.layers.Embedding(VOCAB, 8),  # IndexedSlices gradients
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(3),
    ])
    return model


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs, self.lrs = [], []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(dict(logs))

    def on_train_batch_begin(self, batch, logs=None):
        self.lrs.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


# ---- model.fit with the wrapped optimizer and the broadcast callback ------------------------------
model = build(1000 + r)
first = hvd.allgather_object([w for w in model.get_weights()])
assert not np.array_equal(first[0][0], first[-1][0]), "differently seeded ranks should start apart"
plain = keras.optimizers.Adam(0.01)
opt = hvd.DistributedOptimizer(plain)
assert opt is not plain and isinstance(opt, keras.optimizers.Adam)
assert opt.get_config() == plain.get_config()
model.compile(optimizer=opt, loss=LOSS, metrics=["accuracy"])
raw, averaged = Recorder(), Recorder()
history = model.fit(x_mine, y_mine, batch_size=part, epochs=EPOCHS, shuffle=False, verbose=0,
                    callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), raw,
                               hvd.callbacks.MetricAverageCallback(device=""), averaged])

reference = build(1000)  # what rank 0 started from
reference.compile(optimizer=keras.optimizers.Adam(0.01), loss=LOSS, metrics=["accuracy"])
reference.fit(X.reshape(-1, SEQ), Y.reshape(-1), batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
for w, ref, v in zip(model.get_weights(), reference.get_weights(), model.weights):
    rel = np.abs(w - ref).max() / np.abs(ref).max()
    assert rel <= 1e-5, f"model.fit: {v.path} differs from the single-process run by {rel:.2e} (relative)"
checks += 1
everyone = hvd.allgather_object(model.get_weights())
for k in range(n):
    for a, b in zip(everyone[k], everyone[0]):
        assert np.array_equal(a, b), f"rank {k} and rank 0 hold different weights after fit"
checks += 1

# ---- hvd.load_model: the saved model back with its optimizer wrapped and its state, training on ------------
with tempfile.TemporaryDirectory() as where:
    saved = os.path.join(where, "model.keras")
    model.save(saved)
    loaded = hvd.load_model(saved)
    # again, in the same process (resume, then the best checkpoint): the first load's stand-in class for Adam,
    # alive until the garbage collector frees it, was taken for Adam itself and wrapped twice (an MRO TypeError)
    gc.disable()  # (so that the stand-in surely lives: it did unless a collection ran between the loads)
    try:
        again = hvd.load_model(saved)
    finally:
        gc.enable()
    assert isinstance(again.optimizer, keras.optimizers.Adam) and hasattr(again.optimizer, "_aiacc_reducer")
    del again
assert hasattr(loaded.optimizer, "_aiacc_reducer") and isinstance(loaded.optimizer, keras.optimizers.Adam), \
    type(loaded.optimizer).__mro__
for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):  # Adam's moments and step, restored
    assert np.array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b)), a.path
loaded.fit(x_mine, y_mine, batch_size=part, epochs=1, shuffle=False, verbose=0)  # averaged: the ranks stay equal
reference.fit(X.reshape(-1, SEQ), Y.reshape(-1), batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
for w, ref in zip(loaded.get_weights(), reference.get_weights()):
    assert np.abs(w - ref).max() / np.abs(ref).max() <= 1e-5, "the loaded model trained apart from the reference"
checks += 1

# ---- MetricAverageCallback -----------------------------------------------------------------------
raws = hvd.allgather_object(raw.epochs)
logs = hvd.allgather_object(averaged.epochs)
hists = hvd.allgather_object(history.history)
assert raws[0][0]["loss"] != raws[-1][0]["loss"], "ranks see different data, so their own losses differ"
for k in range(n):
    assert logs[k] == logs[0], f"rank {k} logged {logs[k]}, rank 0 {logs[0]}"
    assert hists[k] == hists[0], f"rank {k} History {hists[k]}, rank 0 {hists[0]}"
for e in range(EPOCHS):
    for key in ("loss", "accuracy"):
        mean = sum(raws[k][e][key] for k in range(n)) / n
        assert abs(logs[0][e][key] - mean) <= 1e-12 * max(1.0, abs(mean)), (key, logs[0][e][key], mean)
        assert hists[0][key][e] == logs[0][e][key]
checks += 1

# ---- LearningRateWarmupCallback ----------------------------------------------------------------
warm_model = build(7)
warm_model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.2)), loss=LOSS)
warmup = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.2, warmup_epochs=2)
seen = Recorder()
steps = 4
warm_model.fit(x_mine[:steps * part], y_mine[:steps * part], batch_size=part, epochs=3, shuffle=False, verbose=0,
               callbacks=[warmup, seen])
want = [0.2 / n * (1 + (n - 1) * (e + (b + 1) / steps) / 2) for e in range(2) for b in range(steps)]
want += [0.2] * steps  # after warmup the rate stays at initial_lr
assert np.allclose(seen.lrs, want, rtol=1e-6), f"warmup learning rates {seen.lrs} != {want}"
assert abs(seen.lrs[0] - 0.2 / n * (1 + (n - 1) / (2 * steps))) < 1e-7

# the warning that momentum_correction is not applied, also for a LossScaleOptimizer around a momentum optimizer
# (mixed_float16's; it looked for the momentum on the loss-scale optimizer, found none, and said nothing)
for make in (lambda: keras.optimizers.SGD(0.1, momentum=0.9),
             lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))):
    warned = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("aiacc.tensorflow.keras.callbacks").addHandler(handler)
    momentum_model = build(9)
    momentum_model.compile(optimizer=hvd.DistributedOptimizer(make()), loss=LOSS)
    momentum_model.fit(x_mine[:part], y_mine[:part], batch_size=part, epochs=1, shuffle=False, verbose=0,
                       callbacks=[hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=1)])
    logging.getLogger("aiacc.tensorflow.keras.callbacks").removeHandler(handler)
    said = sum("momentum_correction is not applied" in m for m in warned)
    assert said == (1 if r == 0 else 0), (type(momentum_model.optimizer).__name__, warned)
checks += 1

# ---- LearningRateScheduleCallback after the warmup, as Horovod's examples chain them ---------------------------
sched_model = build(8)
sched_model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.2)), loss=LOSS)
seen = Recorder()
sched_model.fit(x_mine[:steps * part], y_mine[:steps * part], batch_size=part, epochs=5, shuffle=False, verbose=0,
                callbacks=[hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.2, warmup_epochs=1),
                           hvd.callbacks.LearningRateScheduleCallback(0.2, 0.5, start_epoch=1, end_epoch=3),
                           hvd.callbacks.LearningRateScheduleCallback(0.2, lambda e: 0.1 * e, start_epoch=3,
                                                                      staircase=False), seen])
want = [0.2 / n * (1 + (n - 1) * (b + 1) / steps) for b in range(steps)]  # warmup (epoch 0)
want += [0.2 * 0.5 ** (e - 1) for e in (1, 2) for _ in range(steps)]  # staircase: 0.2, 0.1
want += [0.2 * 0.1 * (e + b / steps) for e in (3, 4) for b in range(steps)]  # per batch, fractional epochs
assert np.allclose(seen.lrs, want, rtol=1e-6), f"scheduled learning rates {seen.lrs} != {want}"
checks += 1
checks += 1

# ---- the gradient buckets: model.fit's dense gradients in buckets, the embedding's outside --------------
fit_buckets = [b for b in _buckets._table.values() if b.specs[0].label.startswith("DistributedOptimizer.")]
assert fit_buckets, "model.fit did not use the gradient buckets"
for b in fit_buckets:
    labels = [label for bucket in b.describe() for label in bucket]
    assert labels and not any("embeddings" in label for label in labels), labels
    assert b.renewed == 0, f"{b.renewed} buckets were copied out though model.fit holds no gradient"
checks += 1

# ---- a model Keras builds in its first step (no Input: Horovod's own Keras example): the broadcast comes after
# the first batch (it built the optimizer for no variables: the first step failed); an array-valued metric
# (two thresholds) is averaged too ----------------------------------------------------------------------------
keras.utils.set_random_seed(500 + r)
lazy = keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1, activation="sigmoid")])
lazy.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="binary_crossentropy",
             metrics=[keras.metrics.Precision(thresholds=[0.3, 0.7], name="prec")])
xb = np.random.default_rng(40 + r).normal(size=(4 * part, 5)).astype(np.float32)
yb = (xb[:, 0] > 0).astype(np.float32)
raw, averaged = Recorder(), Recorder()
lazy.fit(xb, yb, batch_size=part, epochs=1, shuffle=False, verbose=0,
         callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), raw, hvd.callbacks.MetricAverageCallback(),
                    averaged])
everyone = hvd.allgather_object(lazy.get_weights() + [keras.ops.convert_to_numpy(v) for v in lazy.optimizer.variables])
for k in range(n):
    for a, b in zip(everyone[k], everyone[0]):
        assert np.array_equal(a, b), f"rank {k} and rank 0 hold different weights after fit of an unbuilt model"
raws, logs = hvd.allgather_object(raw.epochs[0]["prec"]), hvd.allgather_object(averaged.epochs[0]["prec"])
assert np.shape(raws[0]) == (2,) and not all(np.array_equal(raws[k], raws[0]) for k in range(n)), raws
for k in range(n):
    assert np.array_equal(logs[k], logs[0]), f"rank {k} logged precision {logs[k]}, rank 0 {logs[0]}"
assert np.allclose(logs[0], np.mean(raws, axis=0, dtype=np.float64), rtol=1e-12), (logs[0], raws)  # (float32 / 3 rounds)
checks += 2

# ---- ranks with different numbers of batches: an error on every rank naming each rank's count, before any step (the
# rank with fewer went on while the others waited in a step's reduction: a stall for ever under MetricAverageCallback)
uneven = build(4)
uneven.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), name="uneven"), loss=LOSS)
rows = (n + 1 - r) * part  # rank 0: n + 1 batches, rank 1: n, ...
counts = "; ".join(f"rank {k}: {n + 1 - k}" for k in range(n))
for callback in (hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()):
    raises(ValueError, lambda: uneven.fit(x_mine[:rows], y_mine[:rows], batch_size=part, epochs=2, verbose=0,
                                          callbacks=[callback]),
           type(callback).__name__, "steps per epoch", counts)
raises(ValueError, lambda: uneven.fit(x_mine[:2 * part], y_mine[:2 * part], batch_size=part, epochs=1 + r, verbose=0,
                                      callbacks=[hvd.callbacks.MetricAverageCallback()]), "epochs",
       "; ".join(f"rank {k}: {1 + k}" for k in range(n)))
uneven.fit(x_mine[:2 * part], y_mine[:2 * part], batch_size=part, epochs=1, verbose=0,  # (the job goes on)
           callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()])
checks += 1

# ---- gradients that do not match the variables are an error, not un-averaged updates -------------------
mismatched = build(3)
bad_opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
bad_opt.build(mismatched.trainable_variables)
variables = mismatched.trainable_variables
zeros = [tf.zeros_like(v) for v in variables]
raises(ValueError, lambda: bad_opt.apply(zeros[:-1], variables), "DistributedOptimizer", "4 gradients for 5 variables",
       variables[-1].path)
raises(ValueError, lambda: bad_opt.apply(zeros + zeros[:1]), "6 gradients for 5 variables", variables[0].path)
checks += 1

hvd.shutdown()
say(f"OK rank={r} checks={checks}")
