"""Data-parallel training on scikit-learn's digits with TensorFlow 2 and a custom loop.

    aiaccrun -np 2 python examples/tensorflow_digits.py

The Horovod recipe with one import changed: each rank trains on its shard of every batch inside a
``tf.function``; ``DistributedGradientTape`` hands every gradient to aiacc's engine as soon as
TensorFlow has computed it and returns the averages, so all ranks keep identical weights.
Rank 0 prints loss, test accuracy and samples/s per epoch.

``--batch-size`` is the global batch, the same at any number of ranks: it is split among the ranks as
evenly as it goes (64 on 3 ranks: 22, 21 and 21 samples). The tape averages the ranks' gradients, so each
rank's loss is its samples' sum over ``batch / size`` (for equal shares, their mean): the average is the
mean over the whole batch, what one process computes on it (up to float rounding), with the same learning
rate. ``python examples/tensorflow_digits.py`` alone prints the same losses as any ``aiaccrun -np N``.
A batch smaller than the number of ranks is refused.
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import aiacc.tensorflow as hvd  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split across ranks")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="TensorFlow threads per rank")
    args = parser.parse_args()

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.25, random_state=0)

    tf.keras.utils.set_random_seed(args.seed + rank)  # different on purpose: broadcast_variables makes rank 0's weights everyone's
    model = tf.keras.Sequential([
        tf.keras.Input((64,)),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10),
    ])
    opt = tf.keras.optimizers.Adam(args.lr)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    hvd.broadcast_variables(model.variables, root_rank=0)
    batch = args.batch_size
    if batch < size:
        raise SystemExit(f"--batch-size {batch} is the global batch and smaller than the number of ranks ({size}): "
                         "every rank needs at least one sample of each batch")
    # This rank's part of every global batch: [lo, hi), the parts differing by one sample at most.
    lo = rank * (batch // size) + min(rank, batch % size)
    hi = lo + batch // size + (rank < batch % size)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            # averaged over the ranks by the tape: the mean over the global batch, whatever this rank's share
            loss = loss_fn(yb, model(xb, training=True)) / (batch / size)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for epoch in range(args.epochs):
        order = np.random.default_rng(epoch).permutation(len(X_train))  # same permutation on every rank
        start, seen, losses = time.perf_counter(), 0, []
        for i in range(0, len(order) - batch + 1, batch):
            idx = order[i + lo: i + hi]  # this rank's shard of the batch
            losses.append(float(train_step(tf.constant(X_train[idx]), tf.constant(y_train[idx]))))
            seen += batch
        loss = float(hvd.allreduce(tf.constant(np.mean(losses)), name="loss"))  # the mean over every sample
        elapsed = time.perf_counter() - start
        if rank == 0:
            acc = float(np.mean(np.argmax(model(X_test).numpy(), axis=1) == y_test))
            print(f"epoch {epoch + 1:2d}  loss {loss:.4f}  test accuracy {acc:.3f}  "
                  f"{seen / elapsed:,.0f} samples/s on {size} ranks", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
