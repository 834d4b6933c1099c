"""Data-parallel training on scikit-learn's digits with TensorFlow 2 and a custom loop.

    aiaccrun -np 2 python examples/tensorflow_digits.py

The Horovod recipe with one import changed: each rank trains on its shard of every batch inside a
``tf.function``; ``DistributedGradientTape`` hands every gradient to aiacc's engine as soon as
TensorFlow has computed it and returns the averages, so all ranks keep identical weights.
Rank 0 prints loss, test accuracy and samples/s per epoch.
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
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    hvd.broadcast_variables(model.variables, root_rank=0)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    local = args.batch_size // size
    for epoch in range(args.epochs):
        order = np.random.default_rng(epoch).permutation(len(X_train))  # same permutation on every rank
        start, seen, losses = time.perf_counter(), 0, []
        for i in range(0, len(order) - args.batch_size + 1, args.batch_size):
            idx = order[i + rank * local: i + (rank + 1) * local]  # this rank's shard of the batch
            losses.append(float(train_step(tf.constant(X_train[idx]), tf.constant(y_train[idx]))))
            seen += local * size
        loss = float(hvd.allreduce(tf.constant(np.mean(losses)), name="loss"))
        elapsed = time.perf_counter() - start
        if rank == 0:
            acc = float(np.mean(np.argmax(model(X_test).numpy(), axis=1) == y_test))
            print(f"epoch {epoch + 1:2d}  loss {loss:.4f}  test accuracy {acc:.3f}  "
                  f"{seen / elapsed:,.0f} samples/s on {size} ranks", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
