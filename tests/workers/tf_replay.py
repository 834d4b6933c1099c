"""The TensorFlow replay trains under aiacc.tensorflow's DistributedGradientTape to the closed form.

Each rank feeds x = rank + 1; after STEPS plain-SGD steps from zero every variable of layer i is
-LR * STEPS * coeff_i * mean(rank + 1); the gradients the tape hands back have the profile's shapes
in its order, and the layers asked for their (dilated) times. Usage: tf_replay.py PROFILE DILATE
"""

import sys

import tensorflow as tf

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.get_logger().setLevel("ERROR")

import aiacc.tensorflow as hvd  # noqa: E402
from aiacc.bench.replay import load_profile  # noqa: E402
from aiacc.bench.replay_tf import build_model  # noqa: E402
from report import check_replay, say  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
STEPS, LR = 3, 0.5
profile = load_profile(sys.argv[1])
dilate = float(sys.argv[2])
model = build_model(profile, dilate)
variables = model.trainable_variables
assert [tuple(v.shape) for v in variables] == [shape for _, shape in profile.tensors]
x = tf.fill([8], float(r + 1))
checks = 1
for _ in range(STEPS):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(model(x))
    grads = hvd.DistributedGradientTape(tape).gradient(loss, variables)
    assert [tuple(g.shape) for g in grads] == [tuple(v.shape) for v in variables]
    for v, g in zip(variables, grads):
        v.assign_sub(LR * g)
checks += check_replay(model.clock, profile, dilate, STEPS, LR, n, [(v.name, v.numpy()) for v in variables])
say(f"OK rank={r} checks={checks}")
hvd.shutdown()
