"""Data-parallel softmax regression on scikit-learn's digits, in plain numpy.

    aiaccrun -np 2 python examples/numpy_digits.py

Each rank trains on its own shard of every batch; gradients are averaged by
aiacc's engine (one async allreduce per parameter, fused by the engine), so
every rank keeps identical weights. Rank 0 prints loss, test accuracy and
samples/s per epoch.
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

    local = args.batch_size // size
    for epoch in range(args.epochs):
        order = np.random.default_rng(epoch).permutation(len(X_train))  # same permutation on every rank
        start, seen, losses = time.perf_counter(), 0, []
        for i in range(0, len(order) - args.batch_size + 1, args.batch_size):
            idx = order[i + rank * local: i + (rank + 1) * local]  # this rank's shard of the batch
            xb, yb = X_train[idx], y_train[idx]
            h, p = forward(xb)
            losses.append(-np.log(p[np.arange(len(yb)), yb] + 1e-9).mean())
            d = p.copy()
            d[np.arange(len(yb)), yb] -= 1
            d /= len(yb)
            dh = (d @ params["w2"].T) * (h > 0)
            grads = {"w2": h.T @ d, "b2": d.sum(0), "w1": xb.T @ dh, "b1": dh.sum(0)}
            handles = {k: aiacc.allreduce_async(g.astype(np.float32), name=f"grad.{k}") for k, g in grads.items()}
            for k, handle in handles.items():
                params[k] -= args.lr * aiacc.synchronize(handle)
            seen += len(idx) * size
        loss = aiacc.allreduce(np.float64(np.mean(losses)), name="loss")
        elapsed = time.perf_counter() - start
        if rank == 0:
            acc = (forward(X_test)[1].argmax(1) == y_test).mean()
            print(f"epoch {epoch + 1:2d}  loss {float(loss):.4f}  test accuracy {acc:.3f}  "
                  f"{seen / elapsed:,.0f} samples/s on {size} ranks", flush=True)
    aiacc.shutdown()


if __name__ == "__main__":
    main()
