"""aiacc.keras on Keras' PyTorch or JAX backend (run with KERAS_BACKEND=torch or jax), 2 or more ranks.

* ``model.fit`` (on JAX a jitted train step) with ``DistributedOptimizer`` (SGD with momentum) and ``BroadcastGlobalVariablesCallback``,
  each rank on its share of every global batch and starting from its own random weights, equals plain
  Keras (same backend) trained from rank 0's weights on the whole batches; every rank ends with the same
  weights.
* ``MetricAverageCallback``: every rank logs the same loss, the mean of their own.
* ``backward_passes_per_step=2`` equals plain Keras SGD(2·lr) with Keras' accumulation on the whole batches,
  and the engine reduces once per update (a count of the bytes it reduced).
* ``op=Sum``, a process set of one rank (its own gradients) and a local variable through ``apply``;
  ``broadcast_variables`` from rank 1.
"""

import os

import numpy as np

if os.environ.get("KERAS_BACKEND") == "torch":
    import torch

    torch.set_num_threads(1)

import keras  # noqa: E402

import aiacc  # noqa: E402
import aiacc.keras as hvd  # noqa: E402
from aiacc.exceptions import TensorMismatchError  # noqa: E402
from report import raises, say  # noqa: E402

BACKEND = keras.backend.backend()
assert BACKEND in ("torch", "jax") and BACKEND == os.environ["KERAS_BACKEND"], BACKEND
hvd.init()
r, n = hvd.rank(), hvd.size()
engine = aiacc.get_engine()
checks = 0


def tensor(values):
    """A gradient as the backend makes them (a torch tensor, a JAX array)."""
    return keras.ops.convert_to_tensor(np.asarray(values, np.float32))


def reduced_bytes() -> int:
    """Bytes the engine has reduced so far (through MPI or the host's shared window)."""
    return engine.stats["bytes"]


BATCH = 8  # per rank: each global batch of 8 * n rows is split in n shares, one per rank
rng = np.random.default_rng(11)
features = rng.normal(size=(4 * BATCH * n, 4)).astype(np.float32)  # 4 global batches
targets = rng.normal(size=(4 * BATCH * n, 2)).astype(np.float32)
mine = np.concatenate([np.arange(BATCH * (n * b + r), BATCH * (n * b + r + 1)) for b in range(4)])


def model_of(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(2)])


def weights(model):
    return [keras.ops.convert_to_numpy(w) for w in model.trainable_weights]


# ---- fit: broadcast from rank 0, averaged gradients, averaged metrics -----------------------------------
class Logged(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        self.loss = logs["loss"]


model = model_of(100 + r)  # different on every rank: the broadcast must make them equal
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), name="fit"), loss="mse")
logged = Logged()
model.fit(features[mine], targets[mine], batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(), logged])
ref = model_of(100)  # rank 0's start
ref.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
ref.fit(features, targets, batch_size=n * BATCH, epochs=2, shuffle=False, verbose=0)
for w, v in zip(weights(model), weights(ref)):
    assert np.allclose(w, v, rtol=1e-5, atol=1e-6), ("fit", np.abs(w - v).max())
checks += 1
everyone = hvd.allgather_object((weights(model), logged.loss))
for k, (ws, loss) in enumerate(everyone):
    assert all(np.array_equal(a, b) for a, b in zip(ws, everyone[0][0])), f"rank {k}'s weights differ from rank 0's"
    assert loss == everyone[0][1], f"rank {k} logged loss {loss}, rank 0 {everyone[0][1]}"
checks += 2

# ---- jit_compile=True: Keras compiles its step (torch.compile on torch: dynamo traced aiacc's reduction into the
# engine and failed on every rank, "'dst' must be an array"; XLA on JAX), equal to the same plain Keras run --------
model = model_of(100)
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), name="fit.jit"), loss="mse",
              jit_compile=True)
model.fit(features[mine], targets[mine], batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
for w, v in zip(weights(model), weights(ref)):
    assert np.allclose(w, v, rtol=1e-5, atol=1e-6), ("fit with jit_compile=True", np.abs(w - v).max())
checks += 1

# ---- gradients of two dtypes (on JAX they cross the host callback as one flat array per dtype) -------------
def two_dtypes(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
                             keras.layers.Dense(5, activation="tanh", dtype="bfloat16"), keras.layers.Dense(2)])


model = two_dtypes(7)
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), name="fit.dtypes"), loss="mse")
model.fit(features[mine], targets[mine], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
ref = two_dtypes(7)
ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
ref.fit(features, targets, batch_size=n * BATCH, epochs=1, shuffle=False, verbose=0)
assert [str(w.dtype) for w in model.trainable_weights].count("bfloat16") == 2, model.trainable_weights
# in the order of the weights: the first layer, whose gradients come back through the bfloat16 layer (on JAX at 3
# ranks 1.4e-4 from the reference, 3e-5 at 2: a share of 8 rows and a batch of 24 are not a power of 2 apart, so
# bfloat16 rounds their scaled values differently), the bfloat16 layer, the last layer
tolerances = [1e-3, 1e-3, 2e-2, 2e-2, 1e-4, 1e-4]
for w, v, tol in zip(weights(model), weights(ref), tolerances):
    w, v = w.astype(np.float32), v.astype(np.float32)
    assert w.shape == v.shape and np.allclose(w, v, rtol=tol, atol=tol), ("two dtypes", w.shape, np.abs(w - v).max())
checks += 1

# ---- backward_passes_per_step=2: the sum of two micro-batches, averaged across ranks once per update ------
before = reduced_bytes()
model = model_of(5)
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2,
                                                 name="fit.passes"), loss="mse")
model.fit(features[mine], targets[mine], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
ran = reduced_bytes() - before
ref = model_of(5)
ref.compile(optimizer=keras.optimizers.SGD(0.2, gradient_accumulation_steps=2), loss="mse")
ref.fit(features, targets, batch_size=n * BATCH, epochs=1, shuffle=False, verbose=0)
for w, v in zip(weights(model), weights(ref)):
    assert np.allclose(w, v, rtol=1e-5, atol=1e-6), ("backward_passes_per_step=2", np.abs(w - v).max())
params = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
assert ran == 2 * 4 * params, f"backward_passes_per_step=2: {ran} bytes reduced for 4 micro-batches, 2 updates of " \
    f"{params} float32 parameters"
checks += 2

# ---- apply directly: op=Sum, and a process set of this rank alone -------------------------------------------
x = keras.Variable(np.zeros(3, np.float32))
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Sum, name="sum")
opt.apply([tensor([1.0 + r, 2.0, -r])], [x])
assert np.allclose(keras.ops.convert_to_numpy(x), -np.sum([[1.0 + k, 2.0, -k] for k in range(n)], 0)), \
    keras.ops.convert_to_numpy(x)
alone = [hvd.add_process_set([k]) for k in range(n)]
y = keras.Variable(np.zeros(2, np.float32))
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), name="alone", process_set=alone[r])
opt.apply([tensor([r + 1.0, 0.5])], [y])
assert np.allclose(keras.ops.convert_to_numpy(y), [-(r + 1.0), -0.5]), keras.ops.convert_to_numpy(y)
checks += 2

# a local variable (Horovod's register_local_var, PartialDistributedOptimizer's layers): its own gradient / n
shared, local = keras.Variable(np.zeros(2, np.float32)), keras.Variable(np.zeros(2, np.float32))
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), name="partial")
opt.register_local_var(local)
opt.apply([tensor([r + 1.0] * 2), tensor([r + 1.0] * 2)], [shared, local])
assert np.allclose(keras.ops.convert_to_numpy(shared), -(n + 1) / 2) and \
    np.allclose(keras.ops.convert_to_numpy(local), -(r + 1.0) / n), (shared, local)
assert not any(v is local for v in opt.variables), "the local variable joined the optimizer's variables"
checks += 1
raises(NotImplementedError, lambda: hvd.SyncBatchNormalization(), f"TensorFlow backend, not {BACKEND!r}")
checks += 1

# hvd.broadcast_variables on the backend's variables (Horovod's custom-loop recipe): rank 1's values everywhere
own = model_of(200 + r)
hvd.broadcast_variables(own.variables, root_rank=1)
theirs = model_of(201)
assert all(np.array_equal(a, b) for a, b in zip(weights(own), weights(theirs))), "broadcast_variables from rank 1"
checks += 1

# a model with Dropout: its seed generator's state is a variable too (uint32 on JAX, which no reduction takes: a
# broadcast copies its bits; it was refused, and with it Horovod's callback and elastic state on any such model)
keras.utils.set_random_seed(300 + r)
dropping = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dropout(0.5)])
hvd.broadcast_variables(dropping.variables, root_rank=0)
states = hvd.allgather_object([np.asarray(keras.ops.convert_to_numpy(v)) for v in dropping.variables])
for theirs in states[1:]:
    for a, b in zip(states[0], theirs):
        assert a.dtype == b.dtype and np.array_equal(a, b), (a, b)
assert any("seed" in v.path for v in dropping.variables), [v.path for v in dropping.variables]
checks += 1

# gradients whose shapes differ across ranks: an error naming the tensor and the ranks' shapes (on JAX raised by
# the step's host callback, which JAX reports as its XlaRuntimeError carrying aiacc's message)
odd = keras.Variable(np.zeros(2 + r, np.float32))
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), name="mismatch")
raises(Exception, lambda: opt.apply([tensor([1.0] * (2 + r))], [odd]),  # (by its place in the optimizer's list)
       "tensor 'mismatch.0': shape differs across ranks (" + "; ".join(f"rank {k}: ({2 + k},)" for k in range(n)) + ")")
checks += 1

# a layer frozen on rank 1 only, in fit (the callbacks, verbose=0: nothing reads a step's results): an error from fit
# on every rank naming the gradients, with their layers on the rank that has them. On JAX the failed reduction's
# error stayed in the compiled step's results, which nothing read: fit returned, the weights were that error (raised
# where read: model.save) and the job could exit 0
keras.utils.set_random_seed(400)
hidden = keras.layers.Dense(5, name="hidden")
frozen = keras.Sequential([keras.Input((4,)), hidden, keras.layers.Dense(2, name="head")], name="half_frozen")
hidden.trainable = r != 1
frozen.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), name="frozen"), loss="mse")
said = raises(TensorMismatchError, lambda: frozen.fit(
    features[mine], targets[mine], batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
    callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]),
    "the number of gradients to average differs across ranks (rank 0: 4; rank 1: 2", "'frozen.2.kernel'")
assert r == 1 or "'frozen.2.kernel' is 'half_frozen/head/kernel'" in said, said
checks += 1

# variables of different shapes broadcast (Horovod's callback, a resumed model of another width): named by the path
# of the variable on each rank, as on TensorFlow's backend (before: by its place in the list only)
unlike = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5 + r, name="wide")], name="unlike")
raises(TensorMismatchError, lambda: hvd.broadcast_variables(unlike.variables, root_rank=0),
       "tensor 'broadcast_variables.0': shape differs across ranks (rank 0: (4, 5); rank 1: (4, 6))",
       f"(on rank {r}: 'broadcast_variables.0' is variable 'unlike/wide/kernel')")
checks += 1

say(f"OK rank={r} checks={checks}")
