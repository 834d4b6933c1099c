"""Keras 3 on PyTorch (KERAS_BACKEND=torch): ranks whose gradients do not match get an error naming the variable,
on every rank, at once (run with the stall check far away: only these checks can end a step).

* With gradient accumulation (backward_passes_per_step=2) or op=Adasum the gradients go as one grouped allreduce,
  whose error named a gradient by its place in the group only: "tensor 'DistributedOptimizer.gradients' (entry 0
  of the group): shape differs", "number of tensors differs (rank 0: 4; rank 1: 3)". Now it names the gradient as
  the TensorFlow backend does ('<optimizer name>.<index>.<variable name>', the same on every rank) and, on each
  rank, the variable's Keras path there ('sequential/dense/kernel').
* Through the gradient buckets (the default) the error named the label already; now the path too.
* After each error, a step over matching variables on every rank still averages the gradients.
"""

import numpy as np

import keras

import aiacc.keras as hvd
from aiacc import TensorMismatchError
from report import raises, say

hvd.init()
r, n = hvd.rank(), hvd.size()
checks = 0
x, y = np.ones((8, 3), np.float32), np.ones((8, 1), np.float32)


def model(width, name, **kw):
    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(width, name=f"{name}_hidden", kernel_initializer="ones"),
                          keras.layers.Dense(1, name=f"{name}_out", kernel_initializer="ones")], name=name)
    m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), name=name, **kw), loss="mse")
    return m


def expect(words, fn):
    global checks
    raises(TensorMismatchError, fn, *words)
    checks += 1


# another width on rank 1: the first kernel's shape differs
for how, kw in (("buckets", {}), ("accumulation", dict(backward_passes_per_step=2)), ("adasum", dict(op=hvd.Adasum))):
    expect([f"tensor '{how}.0.kernel': shape differs across ranks (rank 0: (3, 4); rank 1: (3, 5))",
            f"(on rank {r}: '{how}.0.kernel' is '{how}/{how}_hidden/kernel')"],
           lambda: model(4 if r == 0 else 5, how, **kw).fit(x, y, batch_size=4, epochs=1, verbose=0))

# a gradient that rank 1 does not have (None there), with Adasum: the group differed in its number of tensors
m = model(4, "unused", op=hvd.Adasum)
opt = m.optimizer
variables = m.trainable_variables
opt.build(variables)
grads = [keras.ops.ones(v.shape) for v in variables]
if r == 1:
    grads[2] = None  # (the output layer's kernel)
expect(["the number of gradients to average differs across ranks (rank 0: 4; rank 1: 3)",
        "only rank 0 has 'unused.2.kernel'", *(["(on rank 0: 'unused.2.kernel' is 'unused/unused_out/kernel')"]
                                               if r == 0 else [])],
       lambda: opt.apply(grads, variables))

# then matching gradients still average, on each path (each rank's data differs: the same weights on every rank
# means they trained on averaged gradients)
for how, kw in (("buckets", {}), ("accumulation", dict(backward_passes_per_step=2)), ("adasum", dict(op=hvd.Adasum))):
    m = model(4, f"good_{how}", **kw)
    m.fit(x * (r + 1), y, batch_size=4, epochs=1, verbose=0)
    w = keras.ops.convert_to_numpy(m.trainable_variables[0].value)
    ws = hvd.allgather_object(w)
    assert all(np.array_equal(ws[0], v) for v in ws), how  # (the same updates on every rank)
    checks += 1

say(f"OK rank={r} checks={checks}")
hvd.shutdown()
