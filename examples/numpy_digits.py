"""Data-parallel softmax regression on scikit-learn's digits, in plain numpy.

    aiaccrun -np 2 python examples/numpy_digits.py

Each rank trains on its own shard of every batch; gradients are summed by
aiacc's engine (one async allreduce per parameter, fused by the engine), so
every rank keeps identical weights. Rank 0 prints loss, test accuracy and
samples/s per epoch.

``--batch-size`` is the global batch, the same at any number of ranks: it is
split among the ranks as evenly as it goes (64 on 3 ranks: 22, 21 and 21
samples), and each rank's gradient is its samples' sum divided by the global
batch, so the sum over the ranks is the mean over the whole batch. Every step
therefore computes what one process computes on the same batch (up to float
rounding), with the same learning rate: ``python examples/numpy_digits.py``
alone prints the same losses as any ``aiaccrun -np N``. A batch smaller than
the number of ranks is refused.
"""

import argparse
import time

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import aiacc


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split across ranks")
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args()

    aiacc.init()
    rank, size = aiacc.rank(), aiacc.size()
    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.25, random_state=0)
    hidden = 64
    rng = np.random.default_rng(0)  # same seed everywhere; broadcast makes sure anyway
    params = {
        "w1": (rng.standard_normal((64, hidden)) * 0.1).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (rng.standard_normal((hidden, 10)) * 0.1).astype(np.float32),
        "b2": np.zeros(10, np.float32),
    }
    params = {k: aiacc.broadcast(v, root_rank=0, name=f"init.{k}") for k, v in params.items()}

    def forward(xb):
        h = np.maximum(xb @ params["w1"] + params["b1"], 0)
        logits = h @ params["w2"] + params["b2"]
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        return h, p

    batch = args.batch_size
    if batch < size:
        raise SystemExit(f"--batch-size {batch} is the global batch and smaller than the number of ranks ({size}): "
                         "every rank needs at least one sample of each batch")
    # This rank's part of every global batch: [lo, hi), the parts differing by one sample at most.
    lo = rank * (batch // size) + min(rank, batch % size)
    hi = lo + batch // size + (rank < batch % size)
    for epoch in range(args.epochs):
        order = np.random.default_rng(epoch).permutation(len(X_train))  # same permutation on every rank
        start, steps, loss_sum = time.perf_counter(), 0, 0.0
        for i in range(0, len(order) - batch + 1, batch):
            idx = order[i + lo: i + hi]  # this rank's shard of the batch
            xb, yb = X_train[idx], y_train[idx]
            h, p = forward(xb)
            loss_sum += float(-np.log(p[np.arange(len(yb)), yb] + 1e-9).sum())
            d = p.copy()
            d[np.arange(len(yb)), yb] -= 1
            d /= batch  # this rank's part of the mean over the global batch (the ranks' parts are summed)
            dh = (d @ params["w2"].T) * (h > 0)
            grads = {"w2": h.T @ d, "b2": d.sum(0), "w1": xb.T @ dh, "b1": dh.sum(0)}
            handles = {k: aiacc.allreduce_async(g.astype(np.float32), op=aiacc.Sum, name=f"grad.{k}")
                       for k, g in grads.items()}
            for k, handle in handles.items():
                params[k] -= args.lr * aiacc.synchronize(handle)
            steps += 1
        seen = steps * batch
        loss = aiacc.allreduce(np.float64(loss_sum), op=aiacc.Sum, name="loss") / seen  # mean over every sample
        elapsed = time.perf_counter() - start
        if rank == 0:
            acc = (forward(X_test)[1].argmax(1) == y_test).mean()
            print(f"epoch {epoch + 1:2d}  loss {float(loss):.4f}  test accuracy {acc:.3f}  "
                  f"{seen / elapsed:,.0f} samples/s on {size} ranks", flush=True)
    aiacc.shutdown()


if __name__ == "__main__":
    main()
