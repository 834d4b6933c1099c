"""aiacc.keras' collectives on Keras' TensorFlow, PyTorch or JAX backend (KERAS_BACKEND), 2 or more ranks.

* Horovod's Keras argument order: ``allreduce(value, name, average)`` with ``average=False`` positional sums
  (before: ``average`` was the second argument, a name averaged and ``False`` was ignored), prescale and op
  by keyword; ``reducescatter(value, name, op)``; ``value=`` by keyword.
* On the PyTorch and JAX backends the results are the backend's tensors (a torch tensor, a jax.Array; before
  TensorFlow's), of the input's dtype; a torch tensor that requires grad and a Keras variable are taken (before
  the torch tensor failed in TensorFlow's conversion); allgather of uneven rows, broadcast from rank 1,
  alltoall with splits (both parts), the grouped forms, process_set passed through.
* ``broadcast_`` assigns rank 1's values to Keras variables (before: AttributeError 'read_value' on those
  backends, and of Keras 3 variables on TensorFlow's), returns them, and refuses a value that is no variable by its position and type.
"""

import os

import numpy as np

if os.environ.get("KERAS_BACKEND") == "torch":
    import torch

    torch.set_num_threads(1)

import keras  # noqa: E402

import aiacc.keras as hvd  # noqa: E402
from report import raises, say  # noqa: E402

BACKEND = keras.backend.backend()
assert BACKEND == os.environ["KERAS_BACKEND"], BACKEND
hvd.init()
r, n = hvd.rank(), hvd.size()
checks = 0
NATIVE = {"tensorflow": "tensorflow", "torch": "torch", "jax": "jax"}[BACKEND]


def value(values, dtype="float32"):
    return keras.ops.convert_to_tensor(np.asarray(values, dtype))


def same(what, got, want, dtype="float32"):
    """``got`` is a tensor of this backend with ``want``'s values and ``dtype``."""
    global checks
    assert type(got).__module__.split(".")[0] in (NATIVE, "jaxlib"), (what, type(got))
    got = keras.ops.convert_to_numpy(got)
    assert got.dtype == np.dtype(dtype) and got.shape == np.shape(want) and np.array_equal(got, want), \
        (what, got, want, got.dtype)
    checks += 1


def mine_of(k):
    return [1.0 + k, 10.0 * (k + 1)]


mine = mine_of(r)
SUM = np.sum([mine_of(k) for k in range(n)], 0)
AVG = SUM / n  # (exact in float32 at 2, 3 and 4 ranks)
same("allreduce(value, name, False): Sum", hvd.allreduce(value(mine), "sum.positional", False), SUM)
same("allreduce(value, name): Average", hvd.allreduce(value(mine), "avg.positional"), AVG)
same("allreduce(op=Sum, prescale_factor=2)", hvd.allreduce(value(mine), name="scaled", op=hvd.Sum, prescale_factor=2.0),
     2 * SUM)
same("allreduce of int32", hvd.allreduce(value([r, 7], "int32"), "ints", average=False), [n * (n - 1) // 2, 7 * n],
     "int32")
# n rows, row j of rank k is (j + 1) * (k + 1): rank r keeps the sum of row r
same("reducescatter(value, name, op)", hvd.reducescatter(value([[(j + 1.0) * (r + 1)] for j in range(n)]), "rs", hvd.Sum),
     [[(r + 1.0) * n * (n + 1) / 2]])
same("allgather, uneven rows", hvd.allgather(value=value(np.full((1 + r, 2), r)), name="ag"),
     np.concatenate([np.full((1 + k, 2), k) for k in range(n)]))
same("broadcast from rank 1", hvd.broadcast(value=value(mine), root_rank=1, name="bc"), mine_of(1))
# every rank sends j + 1 rows to rank j, row i of rank k holding k + 10 i
starts = [j * (j + 1) // 2 for j in range(n + 1)]
rows, splits = hvd.alltoall(value([r + 10.0 * i for i in range(starts[n])]), splits=[j + 1 for j in range(n)],
                            name="a2a")
same("alltoall rows", rows, [k + 10.0 * i for k in range(n) for i in range(starts[r], starts[r + 1])])
same("alltoall received splits", splits, [r + 1] * n, "int32")
pair = hvd.grouped_allreduce([value(mine), value([r])], op=hvd.Sum, name="grouped")
assert isinstance(pair, list) and len(pair) == 2, pair
same("grouped_allreduce [0]", pair[0], SUM)
same("grouped_allreduce [1]", pair[1], [n * (n - 1) / 2])
same("grouped_allgather", hvd.grouped_allgather([value([r])], name="gag")[0], np.arange(n))
same("grouped_reducescatter", hvd.grouped_reducescatter([value(np.arange(1.0, n + 1))], op=hvd.Sum, name="grs")[0],
     [(r + 1.0) * n])
same("allreduce(process_set=)", hvd.allreduce(value(mine), "set", process_set=hvd.global_process_set), AVG)

same("allreduce of a Python list: float32, as Keras makes it", hvd.allreduce([1.0 + r, 2.0], "list"), [(n + 1) / 2, 2.0])
if BACKEND == "jax":  # inside a jitted function: refused by name (it was JAX's TracerArrayConversionError)
    import jax  # noqa: E402

    raises(TypeError, lambda: jax.jit(lambda v: hvd.allreduce(v, "jitted"))(np.ones(2, np.float32)),
           "run eagerly, not inside a jitted JAX function")
    checks += 1

weights = keras.Variable(np.full(3, 1.0 + r, np.float32), name="w")
same("allreduce of a Keras variable", hvd.allreduce(weights, "variable"), [(n + 1) / 2] * 3)
if BACKEND == "torch":
    import torch  # noqa: E402

    leaf = torch.tensor(mine, requires_grad=True)
    same("allreduce of a torch tensor that requires grad", hvd.allreduce(leaf * 2, "grad"), 2 * AVG)
    same("allreduce of the variable's torch value", hvd.allreduce(weights.value, "varvalue"), [(n + 1) / 2] * 3)

out = hvd.broadcast_([weights], 1, name="assign")
same("broadcast_ returns rank 1's values", out[0], [2.0, 2.0, 2.0])
same("broadcast_ assigned the variable", weights.value, [2.0, 2.0, 2.0])
if BACKEND == "tensorflow":  # in a graph: the value read after the assignment
    import tensorflow as tf  # noqa: E402

    weights.assign(np.full(3, 5.0 + r, np.float32))
    same("broadcast_ in a tf.function", tf.function(lambda: hvd.broadcast_([weights], 0, name="graph"))()[0],
         [5.0, 5.0, 5.0])
else:
    raises(TypeError, lambda: hvd.broadcast_([weights, value(mine)], 0), "element 1", "keras.Variable")
    checks += 1

# the optimizer's class given where an instance goes: named as such (it said "got type")
raises(TypeError, lambda: hvd.DistributedOptimizer(keras.optimizers.Adam), "got the class Adam: pass an instance, "
       "Adam(...)")
checks += 1

# Keras 3's seed generators (a Dropout's) stay each rank's own through BroadcastGlobalVariablesCallback and an
# elastic state's sync(): one process draws a mask per row of the whole batch; broadcast, every rank drew rank 0's
keras.utils.set_random_seed(100 + r)
net = keras.Sequential([keras.Input((64,)), keras.layers.Dropout(0.5), keras.layers.Dense(2)])
net.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
net.fit(np.ones((4, 64), np.float32), np.zeros((4, 2), np.float32), batch_size=2, epochs=1, verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])


def masks_and_kernels():
    dropped = keras.ops.convert_to_numpy(net.layers[0](np.ones((1, 64), np.float32), training=True)) == 0
    rows = keras.ops.convert_to_numpy(hvd.allgather(value(np.concatenate([dropped[0], net.get_weights()[0].ravel()])[None])))
    return rows[:, :64], rows[:, 64:]


for when in ("fit", "sync"):
    if when == "sync":
        hvd.elastic.KerasState(net).sync()
    masks, kernels = masks_and_kernels()
    assert all(np.array_equal(kernels[0], k) for k in kernels[1:]), f"after {when}: the weights differ across ranks"
    assert not all(np.array_equal(masks[0], m) for m in masks[1:]), f"after {when}: every rank drew the same mask"
    checks += 1
say(f"OK rank={r} checks={checks}")
