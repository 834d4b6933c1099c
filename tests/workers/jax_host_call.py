"""aiacc.keras on JAX (run with KERAS_BACKEND=jax, 2 ranks): the host call through which Keras' compiled train step
reaches aiacc (``_jax_call.host_call``), as the native XLA custom call and as its ``io_callback`` fallback.

* Results equal to the function run on numpy, for float32, bfloat16, int32 and bool arguments, several results and a
  zero-size array, compiled and eagerly, on both paths.
* An exception of the function reaches the caller with its type and message, on both paths.
* A compiled function that holds the native call keeps JAX's C++ dispatch: after its first call, JAX's Python
  executor (``pxla.ExecuteReplicated.__call__``) runs for none of the next calls; with ``io_callback`` it runs for
  every one (what made each Keras step cost ~28 µs per variable more).
* ``model.fit`` with ``DistributedOptimizer`` from different initial weights and the broadcast callback trains the
  same weights on both paths (the reduction, the same-start check and the finite check of a loss-scale optimizer
  going through each).
"""

import os

import numpy as np

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import ml_dtypes  # noqa: E402
from jax._src.interpreters import pxla  # noqa: E402

import aiacc.keras as hvd  # noqa: E402
from aiacc.tensorflow.keras import _jax_call  # noqa: E402
from report import raises, say  # noqa: E402

assert keras.backend.backend() == "jax" == os.environ["KERAS_BACKEND"]
hvd.init()
r = hvd.rank()
checks = 0

executed = []
_call = pxla.ExecuteReplicated.__call__


def counted(self, *args):
    executed.append(1)
    return _call(self, *args)


pxla.ExecuteReplicated.__call__ = counted


def host(a, b, c, d, e):
    return [a * 2 + c.astype(np.float32), np.logical_not(d), b, e + 1, np.array(a.sum(), np.float32)]


args = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1.5, -2.25], ml_dtypes.bfloat16),
        np.array([[1, 2, 3], [4, 5, 6]], np.int32), np.array([True, False]), np.zeros((0, 4), np.float32)]
want = host(*args)
structs = [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in want]


def boom(a):
    raise ValueError(f"the tensor 'w' on rank {r} is wrong")


for native in (True, False):
    _jax_call._loaded = None if native else False  # (None: built or loaded again at the next call)
    assert _jax_call._native() is native, native

    def f(*xs):  # (new functions each round: jax.jit caches its compilations per function)
        return _jax_call.host_call(host, structs, *xs)

    def g(x):
        return _jax_call.host_call(boom, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    for run in (jax.jit(f), f):
        got = run(*[jnp.asarray(a) for a in args])
        for w, o in zip(want, got):
            assert o.dtype == w.dtype and o.shape == w.shape and np.array_equal(np.asarray(o), w), (native, w, o)
    raises(Exception, lambda: jax.block_until_ready(jax.jit(g)(jnp.ones(3))), "ValueError",
           f"the tensor 'w' on rank {r} is wrong")
    compiled, inputs = jax.jit(f), [jnp.asarray(a) for a in args]
    jax.block_until_ready(compiled(*inputs))
    del executed[:]
    for _ in range(5):
        jax.block_until_ready(compiled(*inputs))
    assert len(executed) == (0 if native else 5), (native, len(executed))
    checks += 4


def fit(native: bool, loss_scale: bool):
    _jax_call._loaded = None if native else False
    keras.utils.set_random_seed(10 + r)  # each rank its own initial weights: the callback broadcasts rank 0's
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.05, momentum=0.9)
    if loss_scale:
        opt = keras.optimizers.LossScaleOptimizer(opt)
    model.compile(optimizer=hvd.DistributedOptimizer(opt), loss="mse")
    data = np.random.RandomState(100 + r)
    x, y = data.randn(32, 4).astype("float32"), data.randn(32, 1).astype("float32")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    return [np.asarray(keras.ops.convert_to_numpy(v)) for v in model.trainable_variables]


for loss_scale in (False, True):
    a, b = fit(True, loss_scale), fit(False, loss_scale)
    for u, v in zip(a, b):
        assert np.array_equal(u, v), (loss_scale, np.abs(u - v).max())
    for theirs in hvd.allgather_object(a)[1:]:
        assert all(np.array_equal(u, v) for u, v in zip(a, theirs)), "ranks differ"
    checks += 1

say(f"OK rank={r} checks={checks}")
