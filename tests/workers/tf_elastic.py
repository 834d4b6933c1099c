"""Restart-based recovery with aiacc.tensorflow's hvd.elastic: a Keras model trained by a custom loop with
DistributedGradientTape and a TensorFlowKerasState committed every step; on the first start rank KILL_RANK
kills itself with SIGKILL at step KILL_STEP. Restarted by ``aiaccrun --max-restarts``, the job resumes from
the last commit and ends with the variables of one process trained on the whole batch (1e-5 relative).
Usage: tf_elastic.py KILL_RANK KILL_STEP"""

import sys

import numpy as np
import tensorflow as tf

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.get_logger().setLevel("ERROR")

import keras  # noqa: E402

import aiacc.tensorflow as hvd  # noqa: E402
from report import kill_on_first_start, say  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
KILL_RANK, KILL_STEP = int(sys.argv[1]), int(sys.argv[2])
STEPS, BATCH = 10, 8
rng = np.random.default_rng(0)
X = rng.normal(size=(STEPS, BATCH, 5)).astype(np.float32)
Y = rng.integers(0, 3, size=(STEPS, BATCH)).astype(np.int32)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    opt.build(model.trainable_variables)
    return model, opt


model, opt = build()
state = hvd.elastic.TensorFlowKerasState(model, opt, step=0)
rows = slice(r * BATCH // n, (r + 1) * BATCH // n)


@hvd.elastic.run
def train(state):
    say(f"RESUME rank={r} step={state.step}")
    while state.step < STEPS:
        kill_on_first_start(r == KILL_RANK and state.step == KILL_STEP)
        x, y = X[state.step][rows], Y[state.step][rows]
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        state.step += 1
        state.commit()


train(state)
ref, ref_opt = build()
for step in range(STEPS):
    with tf.GradientTape() as tape:
        loss = loss_fn(Y[step], ref(X[step]))
    ref_opt.apply_gradients(zip(tape.gradient(loss, ref.trainable_variables), ref.trainable_variables))
for i, (a, b) in enumerate(zip(model.variables, ref.variables)):
    assert np.allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6), f"variable {i} on rank {r}"
say(f"OK rank={r} restarts={hvd.elastic.restart_count()}")
