"""aiacc.keras.SyncBatchNormalization equals one keras BatchNormalization over the global batch: outputs, input
gradients, the sums over ranks of the gamma/beta gradients and the moving statistics, eagerly and in a
tf.function, for (N, C) and (N, H, W, C) inputs and uneven per-rank batch sizes; bad arguments are errors."""

import numpy as np
import tensorflow as tf

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.get_logger().setLevel("ERROR")

import keras  # noqa: E402

import aiacc.keras as hvd  # noqa: E402
from report import raises, say  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
checks = 0


def close(what, got, want, tol=1e-4):
    global checks
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.allclose(got, want, rtol=tol, atol=tol), f"{what} on rank {r}: max err {np.abs(got - want).max()}"
    checks += 1


cases = [((4,), lambda k: 3), ((5,), lambda k: k + 2), ((3, 3, 2), lambda k: 2 * k + 1)]
for i, (shape, rows_of) in enumerate(cases):
    for mode in ("eager", "tf.function"):
        tag = f"case {i} {mode}"
        # (Horovod's fused=False, accepted: it was Keras' "Unrecognized keyword arguments")
        sync = hvd.SyncBatchNormalization(momentum=0.8, name=f"sbn_{i}_{mode[0]}", fused=False)
        ref = keras.layers.BatchNormalization(momentum=0.8)
        sync.build((None, *shape))
        ref.build((None, *shape))
        rng = np.random.default_rng(i)
        gamma, beta = rng.uniform(0.5, 1.5, shape[-1]), rng.uniform(-0.5, 0.5, shape[-1])
        for layer in (sync, ref):
            layer.gamma.assign(gamma.astype(np.float32))
            layer.beta.assign(beta.astype(np.float32))

        def grads(layer, x, w):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x, training=True)
                loss = tf.reduce_sum(y * w)
            return (y, *tape.gradient(loss, [x, layer.gamma, layer.beta]))

        run = tf.function(grads) if mode == "tf.function" else grads
        for step in range(3):
            g = np.random.default_rng(100 * i + step)
            xs = [g.normal(size=(rows_of(k), *shape)).astype(np.float32) for k in range(n)]
            whole = np.concatenate(xs)
            w = tf.constant(np.linspace(-1, 1, int(np.prod(shape))).reshape(shape).astype(np.float32))
            y, dx, dgamma, dbeta = run(sync, tf.constant(xs[r]), w)
            ry, rdx, rdgamma, rdbeta = grads(ref, tf.constant(whole), w)
            start = sum(rows_of(k) for k in range(r))
            rows = slice(start, start + rows_of(r))
            close(f"{tag} step {step} output", y, ry.numpy()[rows])
            close(f"{tag} step {step} input gradient", dx, rdx.numpy()[rows])
            close(f"{tag} step {step} gamma gradient (sum over ranks)", hvd.allreduce(dgamma, op=hvd.Sum), rdgamma)
            close(f"{tag} step {step} beta gradient (sum over ranks)", hvd.allreduce(dbeta, op=hvd.Sum), rdbeta)
        close(f"{tag} moving_mean", sync.moving_mean, ref.moving_mean)
        close(f"{tag} moving_variance", sync.moving_variance, ref.moving_variance)
        x = tf.constant(np.ones((2, *shape), np.float32))
        close(f"{tag} inference output", sync(x, training=False), ref(x, training=False))

raises(ValueError, lambda: hvd.SyncBatchNormalization(synchronized=True), "synchronized=True")
from aiacc.tensorflow.sync_batch_norm import SyncBatchNormalization  # noqa: E402 - Horovod's module path

assert SyncBatchNormalization is hvd.SyncBatchNormalization
raises(ValueError, lambda: hvd.SyncBatchNormalization(renorm=True), "renorm=True")
raises(ValueError, lambda: hvd.SyncBatchNormalization(fused=True), "fused=True")
checks += 3
say(f"OK rank={r} checks={checks}")
