"""Data-parallel ``model.fit`` on scikit-learn's digits with Keras 3 and aiacc.keras.

    aiaccrun -np 2 python examples/keras_digits.py
    KERAS_BACKEND=torch aiaccrun -np 2 python examples/keras_digits.py     (Keras on PyTorch, unchanged)
    KERAS_BACKEND=jax aiaccrun -np 2 python examples/keras_digits.py       (Keras on JAX, unchanged)

Horovod's Keras recipe: wrap the optimizer, add the callbacks, give each rank its shard of the data.
``model.fit`` itself is unchanged. Rank 0 prints the (rank-averaged) logs and the test accuracy.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import keras  # noqa: E402

import aiacc.keras as hvd  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch")
    parser.add_argument("--lr", type=float, default=0.001, help="learning rate of one rank (scaled by size)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="TensorFlow threads per rank")
    args = parser.parse_args()
    for flag in ('epochs', 'batch_size'):  # (0 divided by zero, or trained nothing and exited 0)
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.25, random_state=0)
    # Each rank its own part of the data, all parts the same length: every step averages the gradients
    # of all ranks, so fit must run the same number of steps on each (the callbacks check that).
    even = len(X_train) // size * size
    X_shard, y_shard = X_train[:even][rank::size], y_train[:even][rank::size]

    keras.utils.set_random_seed(args.seed + rank)  # different on purpose: the broadcast callback gives everyone rank 0's
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
    lr = args.lr * size  # the usual scaling with the global batch
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(lr)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                  jit_compile=False)  # Keras' default turns XLA on where there is a GPU: aiacc cannot run in XLA
    model.fit(X_shard, y_shard, batch_size=args.batch_size, epochs=args.epochs, verbose=2 if rank == 0 else 0,
              callbacks=[
                  hvd.callbacks.BroadcastGlobalVariablesCallback(0),  # everyone starts from rank 0's weights
                  hvd.callbacks.MetricAverageCallback(),  # logs averaged over the ranks
                  hvd.callbacks.LearningRateWarmupCallback(initial_lr=lr, warmup_epochs=3),
              ])
    _, acc = model.evaluate(X_test, y_test, verbose=0)
    if rank == 0:
        print(f"test accuracy {acc:.3f} on {size} ranks (Keras on {keras.backend.backend()})", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
