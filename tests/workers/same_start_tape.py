"""A TensorFlow custom loop with ``DistributedGradientTape`` whose ranks start from different weights
(``set_random_seed(rank)``), for the check at the second ``gradient()``. Horovod's recipe: a new tape every step and,
with broadcast, ``broadcast_variables`` of the model and the optimizer after the first step. Prints, per rank, the
check's warnings (``WARNED``) and the collectives each step after the first ran (``COUNTS``), then ``OK rank=<r>``.

argv: broadcast (0/1), traced (0/1: the step in a ``tf.function``, traced once for the first batch and once for the
others, as in Horovod's example), optionally ``alone`` (traced: rank 1's second step differentiates a loss of the hidden
layer only, its output layer's gradients None there alone: that rank's reduction raises an error after the step's
collectives, which it catches and goes on; it prints ``ALONE rank=1 <error>``)."""

import sys
import warnings

import numpy as np
import tensorflow as tf

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.get_logger().setLevel("ERROR")

import keras  # noqa: E402

import aiacc.tensorflow as hvd  # noqa: E402
from report import report_same_start  # noqa: E402

broadcast, traced = sys.argv[1] == "1", sys.argv[2] == "1"
alone = sys.argv[3:] == ["alone"]
hvd.init()
rank = hvd.rank()
keras.utils.set_random_seed(rank)  # each rank its own initial weights
model = keras.Sequential([keras.layers.Dense(5, activation="relu", name="hidden"), keras.layers.Dense(2, name="out")])
opt = keras.optimizers.SGD(0.1, momentum=0.9)


def step(x, y, first, hidden_only=False):
    with tf.GradientTape() as tape:
        out = model.layers[0](x)[:, :2] if hidden_only else model(x)
        loss = tf.reduce_mean(tf.square(out - y))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    if first and broadcast:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)
    return loss


if traced:
    step = tf.function(step)


def collectives() -> int:
    s = hvd.summary()
    return sum(s[k] for k in ("allreduce_requests", "allgather", "broadcast", "alltoall", "reducescatter", "barrier",
                              "adasum"))


data = np.random.RandomState(100 + rank)
counts = []
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    for i in range(6):
        x, y = tf.constant(data.randn(8, 4), tf.float32), tf.constant(data.randn(8, 2), tf.float32)
        if alone and i == 1 and rank == 1:
            try:
                step(x, y, False, True)
                raise AssertionError("rank 1 applied a step without its output layer's gradients")
            except tf.errors.OpError as exc:
                said = [line for line in exc.message.splitlines() if "is None on this rank" in line]
                print(f"ALONE rank={rank} {type(exc).__name__}: {said[0] if said else exc.message}", flush=True)
        else:
            step(x, y, i == 0)
        counts.append(collectives())
report_same_start(rank, seen, counts)
