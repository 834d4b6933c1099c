"""Restart-based recovery of Keras 3 ``model.fit`` with aiacc.keras' elastic callbacks.

Each rank trains a small model with ``hvd.DistributedOptimizer(Adam)`` on its half of every batch (no
shuffling), inside an ``@hvd.elastic.run`` function, with a ``KerasState(model, epoch=0, batch=0)`` kept up to
date by the callbacks in the order of Horovod's documentation (CommitStateCallback first, every 2 batches). On
the first start rank KILL_RANK SIGKILLs itself before batch KILL_BATCH of epoch KILL_EPOCH. Restarted by
``aiaccrun --max-restarts``, the job resumes at the committed epoch and batch: a resume inside an epoch first
fits that epoch's remaining batches, then the remaining epochs.

Prints ``RESUME rank=R epoch=E batch=B`` at every start, ``TRAINED rank=R batches=K`` (batches trained in this
start) and, when the weights equal (1e-5 relative) one process's uninterrupted ``fit`` on the whole batches
with the plain Adam, ``OK rank=R restarts=N``.
Usage: keras_elastic_fit.py KILL_RANK KILL_EPOCH KILL_BATCH [keras2]"""

import sys

import numpy as np
import tensorflow as tf

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.get_logger().setLevel("ERROR")

if sys.argv[4:] == ["keras2"]:  # Keras 2 (tf_keras, TF_USE_LEGACY_KERAS=1): its optimizer has no ``built``
    keras = tf.keras
    import aiacc.tensorflow.keras as hvd  # noqa: E402
else:
    import keras  # noqa: E402

    import aiacc.keras as hvd  # noqa: E402
from report import kill_on_first_start, say  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
KILL_RANK, KILL_EPOCH, KILL_BATCH = (int(a) for a in sys.argv[1:4])
EPOCHS, STEPS, BATCH = 3, 6, 8
part = BATCH // n
rng = np.random.default_rng(0)
X = rng.normal(size=(STEPS, BATCH, 5)).astype(np.float32)
Y = rng.integers(0, 3, size=(STEPS, BATCH)).astype(np.int32)
x_mine = X[:, r * part:(r + 1) * part].reshape(-1, 5)  # this rank's part of every batch, batch after batch
y_mine = Y[:, r * part:(r + 1) * part].reshape(-1)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def build(optimizer):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
    model.compile(optimizer=optimizer, loss=LOSS, jit_compile=False)
    return model


class Counter(keras.callbacks.Callback):
    """Kills this rank at the chosen batch of the first start; counts the batches trained."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.batches = 0

    def on_train_batch_begin(self, batch, logs=None):
        kill_on_first_start(r == KILL_RANK and (self.state.epoch, self.state.batch) == (KILL_EPOCH, KILL_BATCH))

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1


# on TensorFlow also Horovod's warmup over every epoch, before the state's callbacks in the list: a fit that continues an
# epoch counts on from its batches done, and the next fit reads its own steps (it kept the short fit's: the rate ran
# past the warmup's target, 1.5x, the weights 0.43 off the uninterrupted run's)
WARMUP = EPOCHS if keras.backend.backend() == "tensorflow" else 0
LR = 0.01


def warmup_rate(epoch, batch):
    return LR / n * (1 + (n - 1) * (epoch + (batch + 1) / STEPS) / WARMUP)


class ReferenceWarmup(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.model.optimizer.learning_rate = warmup_rate(self.epoch, batch)


model = build(hvd.DistributedOptimizer(keras.optimizers.Adam(LR)))
state = hvd.elastic.KerasState(model, epoch=0, batch=0)
counter = Counter(state)
callbacks = [hvd.elastic.CommitStateCallback(state, batches_per_commit=2), hvd.elastic.UpdateBatchStateCallback(state),
             hvd.elastic.UpdateEpochStateCallback(state), counter]
if WARMUP:
    callbacks.insert(0, hvd.callbacks.LearningRateWarmupCallback(initial_lr=LR, warmup_epochs=WARMUP))


@hvd.elastic.run
def train(state):
    say(f"RESUME rank={r} epoch={state.epoch} batch={state.batch}")
    if state.batch:  # resumed inside an epoch: first the batches of it not trained yet
        rest = slice(state.batch * part, None)
        model.fit(x_mine[rest], y_mine[rest], batch_size=part, shuffle=False, verbose=0, callbacks=callbacks,
                  initial_epoch=state.epoch, epochs=state.epoch + 1)
    model.fit(x_mine, y_mine, batch_size=part, shuffle=False, verbose=0, callbacks=callbacks,
              initial_epoch=state.epoch, epochs=EPOCHS)


train(state)
say(f"TRAINED rank={r} batches={counter.batches}")
assert (state.epoch, state.batch) == (EPOCHS, 0), (state.epoch, state.batch)

reference = build(keras.optimizers.Adam(LR))
reference.fit(X.reshape(-1, 5), Y.reshape(-1), batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[ReferenceWarmup()] if WARMUP else [])
for w, ref, v in zip(model.get_weights(), reference.get_weights(), model.weights):
    rel = np.abs(w - ref).max() / np.abs(ref).max()
    assert rel <= 1e-5, f"{v.path} on rank {r} differs from the uninterrupted run by {rel:.2e} (relative)"
say(f"OK rank={r} restarts={hvd.elastic.restart_count()}")
