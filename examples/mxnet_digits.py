"""Data-parallel Gluon training on scikit-learn's digits with aiacc.mxnet.

    aiaccrun -np 2 python examples/mxnet_digits.py

The two lines that make a Gluon script distributed are marked ``# aiacc``:
the import, and ``DistributedTrainer`` instead of ``gluon.Trainer`` (plus a
``broadcast_parameters`` so every rank starts from rank 0's weights). Each
rank trains on its own shard of every batch; the trainer averages gradients
across ranks while MXNet is still computing the rest of the backward pass.
Rank 0 prints loss, test accuracy and samples/s per epoch. Without
``aiaccrun`` the same script trains alone, exactly as with ``gluon.Trainer``.

``--batch-size`` is the global batch, the same at any number of ranks: it is
split among the ranks as evenly as it goes (64 on 3 ranks: 22, 21 and 21
samples). The trainer averages the ranks' gradient sums and ``step(n)``
divides by ``n``, so every rank passes ``batch / size`` (21.33 on 3 ranks,
not its own share): the step is the mean over the whole batch, what one
process computes on it (up to float rounding), with the same learning rate.
The script alone prints the same losses as under any ``aiaccrun -np N``.
A batch smaller than the number of ranks is refused.
"""

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MXNET_CPU_WORKER_NTHREADS", "1")

import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import aiacc.mxnet as hvd  # noqa: E402  # aiacc (also makes MXNet 1.9.1 importable with numpy 1.26)
import mxnet as mx  # noqa: E402
from mxnet import autograd, gluon, nd  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split across ranks")
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.25, random_state=0)

    mx.random.seed(rank)  # deliberately different; broadcast_parameters makes them equal
    net = gluon.nn.HybridSequential()
    with net.name_scope():
        net.add(gluon.nn.Dense(128, activation="relu"), gluon.nn.Dense(64, activation="relu"), gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)  # aiacc (deferred init: sent after 1st forward)
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd",  # aiacc: was gluon.Trainer
                                     {"learning_rate": args.lr, "momentum": 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    batch = args.batch_size
    if batch < size:
        raise SystemExit(f"--batch-size {batch} is the global batch and smaller than the number of ranks ({size}): "
                         "every rank needs at least one sample of each batch")
    # This rank's part of every global batch: [lo, hi), the parts differing by one sample at most.
    lo = rank * (batch // size) + min(rank, batch % size)
    hi = lo + batch // size + (rank < batch % size)

    for epoch in range(args.epochs):
        order = np.random.default_rng(epoch).permutation(len(X_train))  # same permutation on every rank
        start, steps, losses = time.perf_counter(), 0, []
        for i in range(0, len(order) - batch + 1, batch):
            idx = order[i + lo: i + hi]  # this rank's shard of the batch
            xb, yb = nd.array(X_train[idx]), nd.array(y_train[idx])
            with autograd.record():
                loss = loss_fn(net(xb), yb)
            loss.backward()
            trainer.step(batch / size)  # the ranks' gradient sums, averaged, over batch / size: the batch's mean
            losses.append(loss.sum())
            steps += 1
        seen = steps * batch
        mean_loss = hvd.allreduce(nd.add_n(*losses), op=hvd.Sum, name="loss").asscalar() / seen  # every sample's
        elapsed = time.perf_counter() - start
        if rank == 0:
            acc = (net(nd.array(X_test)).argmax(axis=1).asnumpy() == y_test).mean()
            print(f"epoch {epoch + 1:2d}  loss {mean_loss:.4f}  test accuracy {acc:.3f}  "
                  f"{seen / elapsed:,.0f} samples/s on {size} ranks", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
