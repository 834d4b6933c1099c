"""Data-parallel PyTorch training on scikit-learn's digits (8x8 images, shipped with the package).

    aiaccrun -np 2 python examples/pytorch_digits.py

A Horovod script with only its import changed: each rank trains a small CNN on its own shard
of the training set; DistributedOptimizer averages every gradient across ranks as soon as
backward produces it. Rank 0 prints per-epoch loss, test accuracy and samples/s.
Run it without aiaccrun and it trains alone, unchanged.
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import aiacc.torch as hvd


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def metric_sum(value: float, name: str) -> float:
    return hvd.allreduce(torch.tensor(value, dtype=torch.float64), name=name, op=hvd.Sum).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.002, help="learning rate of one rank (scaled by size)")
    parser.add_argument("--fp16-allreduce", action="store_true", help="send gradients as float16")
    args = parser.parse_args()
    for flag in ('epochs', 'batch_size'):  # (0 divided by zero, or trained nothing and exited 0)
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")

    hvd.init()
    torch.set_num_threads(1)  # one core per rank
    torch.manual_seed(42)
    rank, size = hvd.rank(), hvd.size()

    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    y = torch.tensor(y)
    X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.25, random_state=0, stratify=y)
    # This rank's shards: every size-th sample, starting at its rank.
    X_train, y_train = X_train[rank::size], y_train[rank::size]
    X_test, y_test = X_test[rank::size], y_test[rank::size]

    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * size)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Every rank must take the same number of steps: the shortest shard decides.
    fewest = min(hvd.allgather_object(len(X_train)))
    steps = fewest // args.batch_size
    if steps == 0:
        raise SystemExit(f"--batch-size {args.batch_size} per rank is more than a rank's {fewest} training samples")
    for epoch in range(1, args.epochs + 1):
        model.train()
        order = torch.randperm(len(X_train), generator=torch.Generator().manual_seed(epoch * 1000 + rank))
        start, total = time.perf_counter(), 0.0
        for i in range(steps):
            idx = order[i * args.batch_size:(i + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(X_train[idx]), y_train[idx])
            loss.backward()
            optimizer.step()
            total += loss.item()
        elapsed = time.perf_counter() - start
        model.eval()
        with torch.no_grad():
            correct = (model(X_test).argmax(1) == y_test).sum().item()
        accuracy = metric_sum(correct, "correct") / metric_sum(len(y_test), "count")
        loss = metric_sum(total / steps, "loss") / size
        samples_per_s = metric_sum(steps * args.batch_size / elapsed, "speed")
        if rank == 0:
            print(f"epoch {epoch:2d}  loss {loss:.4f}  test accuracy {accuracy:.3f}  "
                  f"{samples_per_s:,.0f} samples/s on {size} ranks", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
