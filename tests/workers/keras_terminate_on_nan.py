"""Keras' TerminateOnNaN with MetricAverageCallback, a NaN in one rank's second batch (any KERAS_BACKEND): that
rank stops at once, the others a step later (the averaged gradient made every rank's weights NaN). The rank that
stopped first came to MetricAverageCallback's epoch end while the others waited in their next step's reduction: a
stall for ever (Horovod's too). Now every rank returns from fit, with the same averaged logs."""

import numpy as np
import keras

import aiacc.keras as hvd
from report import say

hvd.init()
r, n = hvd.rank(), hvd.size()
rng = np.random.default_rng(r)
x = rng.normal(size=(32, 6)).astype("float32")
y = rng.integers(0, 3, size=(32,))
if r == 1:
    x[9, 2] = np.nan  # one bad row in rank 1's second batch
keras.utils.set_random_seed(r)
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05 * n)),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


class Batches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.done = 0

    def on_train_batch_end(self, batch, logs=None):
        self.done += 1


batches = Batches()
history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                    callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
                               batches, keras.callbacks.TerminateOnNaN()])
# rank 1 stopped after its second batch, rank 0 after its third (its loss NaN from the NaN weights), in epoch 1
assert batches.done == (2 if r == 1 else 3), (r, batches.done)
assert len(history.history["loss"]) == 1 and np.isnan(history.history["loss"][0]), history.history
assert all(np.isnan(w).all() for w in model.get_weights()[:1]), "the averaged NaN gradient reached every rank"
losses = hvd.allgather_object(history.history["loss"], name="losses")
assert all(len(v) == 1 for v in losses), losses
say(f"OK rank={r} checks=3")
