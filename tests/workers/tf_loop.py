"""A custom training loop with DistributedGradientTape: 2 ranks on half of every batch against one model
trained on the whole batch, inside tf.function and eagerly, with an embedding (IndexedSlices gradients)
both gathered and densified. Then broadcast_variables, and steps of a larger model for the timeline
(the test reads it to see gradients sent while later ones were still being computed).

argv: [steps of the timeline model]
"""

import sys

import numpy as np
import tensorflow as tf

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.get_logger().setLevel("ERROR")

import keras  # noqa: E402

import aiacc.tensorflow as hvd  # noqa: E402
from report import say  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
STEPS, BATCH, VOCAB, SEQ = 20, 16, 40, 5
checks = 0

rng = np.random.default_rng(0)
X = rng.integers(0, VOCAB, size=(STEPS, BATCH, SEQ)).astype(np.int32)
Y = rng.integers(0, 3, size=(STEPS, BATCH)).astype(np.int32)
part = BATCH // n
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def build(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((SEQ,), dtype="int32"),
        keras.layers.Embedding(VOCAB, 8),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(3),
    ])


def make_step(model, opt, distributed, densify, **tape_args):
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        if distributed:
            tape = hvd.DistributedGradientTape(tape, **tape_args)
        grads = tape.gradient(loss, model.trainable_variables)
        if densify:  # Adam updates only the rows present in IndexedSlices, every row of a dense gradient
            grads = [tf.convert_to_tensor(g) for g in grads]
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return step


def train(distributed, compiled, densify=False, lr=0.01, optimizer=keras.optimizers.Adam, **tape_args):
    model = build(0)
    opt = optimizer(lr)
    step = make_step(model, opt, distributed, densify, **tape_args)
    if compiled:
        step = tf.function(step)
    for s in range(STEPS):
        if distributed:
            x, y = X[s, r * part:(r + 1) * part], Y[s, r * part:(r + 1) * part]
        else:
            x, y = X[s], Y[s]
        step(tf.constant(x), tf.constant(y))
    return [v.numpy() for v in model.trainable_variables]


def compare(what, got, want, tol=1e-5):
    global checks
    for g, w, v in zip(got, want, build(0).trainable_variables):
        rel = np.abs(g - w).max() / np.abs(w).max()
        assert rel <= tol, f"{what}: variable {v.path} differs from the single-process run by {rel:.2e} (relative)"
    checks += 1


reference = train(False, True)
reference_dense = train(False, True, densify=True)
compare("tf.function, embedding gradients gathered", train(True, True), reference)
compare("tf.function, sparse_as_dense", train(True, True, sparse_as_dense=True), reference_dense)
compare("eager", train(True, False), reference)
compare("tf.function, gradient_predivide_factor=2", train(True, True, gradient_predivide_factor=2.0), reference)
compare("tf.function, fp16 compression", train(True, True, compression=hvd.Compression.fp16), reference, tol=2e-2)
# op=Sum: the summed gradient of two half batches is twice the average: SGD with half the rate
compare("tf.function, op=Sum", train(True, True, op=hvd.Sum, lr=0.05, optimizer=keras.optimizers.SGD),
        train(False, True, lr=0.1, optimizer=keras.optimizers.SGD))

# broadcast_variables makes differently seeded models equal to the root's
model = build(100 + r)
before = hvd.allgather_object([v.numpy() for v in model.variables])
assert any(not np.array_equal(a, b) for a, b in zip(before[0], before[-1])), "seeds should give different weights"
hvd.broadcast_variables(model.variables, root_rank=n - 1)
after = hvd.allgather_object([v.numpy() for v in model.variables])
for k in range(n):
    for a, b in zip(after[k], before[n - 1]):
        assert np.array_equal(a, b), f"rank {k} does not hold rank {n - 1}'s variables after broadcast_variables"
checks += 1

# a model whose backward pass takes long enough to see gradients go out while others are computed
keras.utils.set_random_seed(0)
big = keras.Sequential([keras.Input((512,))] + [keras.layers.Dense(512, activation="relu") for _ in range(4)]
                       + [keras.layers.Dense(10)])
big_opt = keras.optimizers.SGD(0.01)
xb = tf.random.normal([256, 512])
yb = tf.random.uniform([256], 0, 10, tf.int32)


@tf.function
def big_step(x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, big(x, training=True))
    tape = hvd.DistributedGradientTape(tape, name="overlap")
    grads = tape.gradient(loss, big.trainable_variables)
    big_opt.apply_gradients(zip(grads, big.trainable_variables))
    return loss


for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 0):
    big_step(xb, yb)

hvd.shutdown()
say(f"OK rank={r} checks={checks}")
