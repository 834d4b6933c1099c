"""A Keras ``model.fit`` whose ranks start from different weights (``set_random_seed(rank)``), for the check of
``DistributedOptimizer`` at its second update. Keras 3 on its TensorFlow backend (traced), on ``KERAS_BACKEND=torch``
or ``jax``, or Keras 2 under ``TF_USE_LEGACY_KERAS=1``. Prints, per rank, the check's warnings (``WARNED``) and the collectives
each step after the first ran (``COUNTS``), then ``OK rank=<r>``.

argv: ``none`` (no broadcast), ``callback`` (``BroadcastGlobalVariablesCallback(0)`` on a model built in the first
step: it broadcasts after the first batch, Horovod's way), ``local`` (a built model, broadcast at the start but for
the output layer's kernel, the callback's ``local_variables``: it keeps each rank's value); ``eager`` as a second
argument: ``run_eagerly=True``."""

import os
import sys
import warnings

import numpy as np

legacy = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
if legacy or os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow":
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.get_logger().setLevel("ERROR")
    keras = tf.keras if legacy else __import__("keras")
else:
    import keras

import aiacc.tensorflow.keras as hvd  # noqa: E402
from report import report_same_start  # noqa: E402

mode, eager = sys.argv[1], sys.argv[2:] == ["eager"]
hvd.init()
rank = hvd.rank()
keras.utils.set_random_seed(rank)  # each rank its own initial weights
layers = [keras.layers.Dense(8, activation="relu", name="hidden"), keras.layers.BatchNormalization(name="norm"),
          keras.layers.Dense(1, name="out")]
model = keras.Sequential(([keras.Input((4,))] if mode == "local" else []) + layers)
callbacks = []
if mode == "callback":
    callbacks.append(hvd.callbacks.BroadcastGlobalVariablesCallback(0))
elif mode == "local":
    callbacks.append(hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[layers[2].kernel]))
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9)), loss="mse",
              jit_compile=False, run_eagerly=eager)


def collectives() -> int:
    s = hvd.summary()
    return sum(s[k] for k in ("allreduce_requests", "allgather", "broadcast", "alltoall", "reducescatter", "barrier",
                              "adasum"))


class Count(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.counts = []

    def on_train_batch_end(self, batch, logs=None):
        self.counts.append(collectives())


count = Count()
data = np.random.RandomState(100 + rank)  # each rank its own batches (BatchNorm's statistics differ too)
x, y = data.randn(48, 4).astype("float32"), data.randn(48, 1).astype("float32")
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=callbacks + [count])
report_same_start(rank, seen, count.counts)
