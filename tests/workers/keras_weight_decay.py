"""AdamW with ``exclude_from_weight_decay`` (by name and by variable) through ``DistributedOptimizer``, each rank on
its share of every batch, against plain Keras on the whole batches: the excluded variables (which Keras keeps outside
``get_config()``) are still excluded once the wrapper is rebuilt from the config. Prints ``OK rank=<r> checks=4``."""

import numpy as np
import tensorflow as tf

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.get_logger().setLevel("ERROR")

import keras  # noqa: E402

import aiacc.keras as hvd  # noqa: E402
from report import say  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
rng = np.random.default_rng(0)
BATCH = 4 * n
x = rng.normal(size=(3 * BATCH, 3)).astype("float32")
y = rng.normal(size=(3 * BATCH, 2)).astype("float32")


def model_and_optimizer():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="hidden"), keras.layers.Dense(2, name="out")])
    opt = keras.optimizers.AdamW(0.1, weight_decay=0.5)
    # by name (every bias) and by variable (the output layer's kernel): only the hidden kernel decays
    opt.exclude_from_weight_decay(var_list=[model.get_layer("out").kernel], var_names=["bias"])
    return model, opt


def train(model, opt, xs, ys, batch):
    model.compile(optimizer=opt, loss="mse")
    model.fit(xs, ys, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    return [v.numpy() for v in model.weights]


mine = np.concatenate([np.arange(b + r * 4, b + r * 4 + 4) for b in range(0, len(x), BATCH)])  # this rank's shares
model, opt = model_and_optimizer()
got = train(model, hvd.DistributedOptimizer(opt), x[mine], y[mine], 4)
checks = 0
for name, (a, b) in zip(["hidden.kernel", "hidden.bias", "out.kernel", "out.bias"],
                        zip(got, train(*model_and_optimizer(), x, y, BATCH))):
    assert np.allclose(a, b, rtol=1e-5, atol=1e-6), (name, np.abs(a - b).max())
    checks += 1
say(f"OK rank={r} checks={checks}")
