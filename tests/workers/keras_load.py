"""Keras checkpoints with hvd.load_model and the broadcast callback (2 ranks, Keras on TensorFlow):

* Horovod's resume pattern: rank 0 loads a checkpoint written by plain Keras (``keras.optimizers.Adam``), the
  others build the model fresh; ``BroadcastGlobalVariablesCallback`` gives every rank rank 0's state although
  Keras named the optimizer's variables differently there (the broadcast waited forever), and the loaded
  optimizer is wrapped (Keras 3 looks its built-in classes up by module: it came back plain, each rank training
  apart); the ranks end equal.
* A registered custom optimizer: saved plainly it comes back wrapped from hvd.load_model; saved wrapped, plain
  keras.models.load_model finds it (the wrapper was saved under the bare class name).
* A LossScaleOptimizer given to compile (plain, around or inside DistributedOptimizer) comes back from
  hvd.load_model with one wrapper, inside it (both were wrapped; backward_passes_per_step=2 refused the file).
"""

import logging
import os
import shutil
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import aiacc.tensorflow as hvd_tf  # noqa: E402
import aiacc.tensorflow.keras as hvd  # noqa: E402
from report import raises, say  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
checks = 0
rng = np.random.default_rng(0)
x = rng.standard_normal((32, 6)).astype(np.float32)
y = rng.integers(0, 3, 32).astype(np.int32)
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def build(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])


def equal_across_ranks(what, weights):
    global checks
    everyone = hvd.allgather_object([np.asarray(w) for w in weights])
    for k in range(n):
        assert all(np.array_equal(a, b) for a, b in zip(everyone[k], everyone[0])), f"{what}: rank {k} differs"
    checks += 1


@keras.saving.register_keras_serializable(package="aiacc_test")
class MySGD(keras.optimizers.SGD):
    pass


where = tempfile.mkdtemp() if r == 0 else None
where = hvd.broadcast_object(where, 0)
checkpoint = os.path.join(where, "plain.keras")
if r == 0:  # an earlier run's checkpoint, by plain Keras
    plain = build(1)
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss)
    plain.fit(x, y, batch_size=8, epochs=1, verbose=0)
    plain.save(checkpoint)
    keras.backend.clear_session()
hvd.barrier()
if r == 0:
    # Horovod's positional form (filepath, custom_optimizers, custom_objects, compression, legacy_opts); with
    # hvd.Compression.none here and the default on rank 1 (the same gradient buckets: before, rank 0 alone set
    # them up again and the job stalled)
    model = hvd.load_model(checkpoint, None, None, hvd.Compression.none, False)
    assert hasattr(model.optimizer, "_aiacc_reducer"), type(model.optimizer).__mro__
    raises(ValueError, lambda: hvd.load_model(checkpoint, legacy_opts=True), "legacy_opts=True", "Keras 3")
    checks += 2
else:
    model = build(2 + r)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss=loss)
mine = slice(r * 16 // n, (r + 1) * 16 // n)
model.fit(x[mine], y[mine], batch_size=4, epochs=1, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
equal_across_ranks("resumed model", model.get_weights())
equal_across_ranks("resumed optimizer", [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables])

for wrapped in (False, True):
    m = build(5)
    m.compile(optimizer=hvd.DistributedOptimizer(MySGD(0.1)) if wrapped else MySGD(0.1), loss=loss)
    m.fit(x, y, batch_size=8, epochs=1, verbose=0)  # (the same data everywhere: equal files on every rank)
    path = os.path.join(where, f"custom.{wrapped}.{r}.keras")
    m.save(path)
    again = keras.models.load_model(path)  # plain Keras finds the registered class, wrapped or not
    assert type(again.optimizer) is MySGD, type(again.optimizer)
    loaded = hvd.load_model(path)
    assert isinstance(loaded.optimizer, MySGD) and hasattr(loaded.optimizer, "_aiacc_reducer"), \
        type(loaded.optimizer).__mro__
    loaded.fit(x[mine], y[mine], batch_size=4, epochs=1, verbose=0)  # rank-specific data, averaged gradients
    equal_across_ranks(f"custom optimizer (saved {'wrapped' if wrapped else 'plain'}) after hvd.load_model",
                       loaded.get_weights())

def wrappers(opt) -> list:
    """Where the DistributedOptimizers are, outermost first: 'outer' (the optimizer itself), 'inner' (its
    inner_optimizer)."""
    return [where for where, o in (("outer", opt), ("inner", getattr(opt, "inner_optimizer", None)))
            if hasattr(o, "_aiacc_reducer")]


# a LossScaleOptimizer given to compile (either order, or plain Keras'): loaded with exactly one wrapper, inside it
# (both were wrapped: every step reduced twice; with backward_passes_per_step=2 the file was refused)
for saved_as, make in (("plain", lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))),
                       ("Horovod's order", lambda: hvd.DistributedOptimizer(
                           keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)), name="lso.outer")),
                       ("inside", lambda: keras.optimizers.LossScaleOptimizer(
                           hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), name="lso.inner")))):
    m = build(9)
    m.compile(optimizer=make(), loss=loss)
    m.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = os.path.join(where, f"lso.{len(saved_as)}.{r}.keras")
    m.save(path)
    loaded = hvd.load_model(path)
    assert wrappers(loaded.optimizer) == ["inner"], (saved_as, wrappers(loaded.optimizer))
    checks += 1
accumulating = hvd.load_model(path, backward_passes_per_step=2)
assert wrappers(accumulating.optimizer) == ["inner"], wrappers(accumulating.optimizer)
assert accumulating.optimizer.inner_optimizer.gradient_accumulation_steps == 2
checks += 1
loaded.fit(x[mine], y[mine], batch_size=4, epochs=1, verbose=0)
equal_across_ranks("LossScaleOptimizer after hvd.load_model", loaded.get_weights())

# plain keras.models.load_model restores the optimizer unwrapped: fit with the callbacks trains each rank alone (the
# ranks drift apart from rank 0's weights): a warning on each rank says so and what to use; a model whose own
# train_step does the averaging (a DistributedGradientTape) and a wrapped optimizer get none
class Captured(logging.Handler):
    def __init__(self):
        super().__init__()
        self.said = []

    def emit(self, record):
        self.said.append(record.getMessage())


captured = Captured()
logging.getLogger(hvd.callbacks.__name__).addHandler(captured)
unwrapped = keras.models.load_model(checkpoint)
unwrapped.fit(x[mine], y[mine], batch_size=4, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()])
assert len(captured.said) == 1, captured.said
for part in (f"rank {r}: model.fit will train", "not their average over the 2 ranks", "(Adam) is not a "
             "DistributedOptimizer", "keras.models.load_model", "hvd.load_model(path)"):
    assert part in captured.said[0], (part, captured.said[0])
weights = hvd.allgather_object([np.asarray(w) for w in unwrapped.get_weights()])
assert not all(np.array_equal(a, b) for a, b in zip(weights[0], weights[1])), "unwrapped ranks stayed equal"
checks += 1


class OwnStep(keras.Sequential):
    def train_step(self, data):
        import tensorflow as tf
        features, labels = data
        with tf.GradientTape() as tape:
            value = self.compute_loss(x=features, y=labels, y_pred=self(features, training=True))
        tape = hvd_tf.DistributedGradientTape(tape)
        self.optimizer.apply(tape.gradient(value, self.trainable_variables), self.trainable_variables)
        return {"loss": value}


keras.utils.set_random_seed(3)
own = OwnStep([keras.Input((6,)), keras.layers.Dense(3)])
own.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
own.fit(x[mine], y[mine], batch_size=4, epochs=1, verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
equal_across_ranks("own train_step with DistributedGradientTape", own.get_weights())
assert captured.said == captured.said[:1], captured.said  # (resumed, wrapped, own step: no more warnings)
checks += 1

# Horovod's BestModelCheckpoint: the best epoch's model where it is given (rank 0's fit); without a path, an error
best = os.path.join(where, "best.keras")
tracked = build(7)
tracked.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), name="best"), loss=loss)
checkpoints = [hvd.callbacks.BestModelCheckpoint(monitor="loss", filepath=best)] if r == 0 else []
history = tracked.fit(x[mine], y[mine], batch_size=4, epochs=3, verbose=0, callbacks=checkpoints)
if r == 0:
    kept = keras.models.load_model(best)
    assert len(kept.get_weights()) == len(tracked.get_weights()), kept.get_weights()
    checks += 1
local = build(8)
local.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
raises(ValueError, lambda: local.fit(x, y, epochs=1, verbose=0, callbacks=[hvd.callbacks.BestModelCheckpoint()]),
       "BestModelCheckpoint: no filepath")
checks += 1

hvd.barrier()
if r == 0:
    shutil.rmtree(where)
say(f"OK rank={r} checks={checks}")
