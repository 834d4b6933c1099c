"""PyTorch DDP on the ``aiacc`` torch.distributed backend, on scikit-learn's digits.

    aiaccrun -np 2 python examples/pytorch_ddp_digits.py [--sync-bn] [--compile]

A plain DDP script whose only aiacc lines are ``import aiacc.torch`` and the backend name: every DDP
bucket is reduced by the aiacc engine. ``--sync-bn`` turns the model's BatchNorms into
``aiacc.torch.SyncBatchNorm`` (statistics of the global batch); ``--compile`` compiles the model block by
block with torch.compile (regional compilation). Rank 0 prints per-epoch loss and test accuracy.
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import aiacc.torch as hvd  # registers the "aiacc" backend


def block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--sync-bn", action="store_true", help="aiacc.torch.SyncBatchNorm instead of BatchNorm2d")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block of the model")
    args = parser.parse_args()
    for flag in ('epochs', 'batch_size'):  # (0 divided by zero, or trained nothing and exited 0)
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")

    torch.set_num_threads(1)
    dist.init_process_group("aiacc")  # under aiaccrun: rank, size and rendezvous come from the launcher
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(42)

    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    X_train, X_test, y_train, y_test = train_test_split(X, torch.tensor(y), test_size=0.25, random_state=0,
                                                        stratify=y)
    X_train, y_train = X_train[rank::size], y_train[rank::size]
    X_test, y_test = X_test[rank::size], y_test[rank::size]

    model = nn.Sequential(block(1, 16), block(16, 32), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 10))
    if args.sync_bn:
        model = hvd.SyncBatchNorm.convert_sync_batchnorm(model)
    if args.compile:
        for part in (model[0], model[1], model[4]):
            part.compile()
    model = nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's parameters
    optimizer = torch.optim.Adam(model.parameters(), lr=0.002 * size)

    counts = [None] * size
    dist.all_gather_object(counts, len(X_train))
    steps = min(counts) // args.batch_size  # every rank takes the same number of steps
    if steps == 0:
        raise SystemExit(f"--batch-size {args.batch_size} per rank is more than a rank's {min(counts)} training samples")
    for epoch in range(1, args.epochs + 1):
        model.train()
        order = torch.randperm(len(X_train), generator=torch.Generator().manual_seed(epoch * 1000 + rank))
        start, total = time.perf_counter(), torch.zeros(3, dtype=torch.float64)
        for i in range(steps):
            idx = order[i * args.batch_size:(i + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(X_train[idx]), y_train[idx])
            loss.backward()
            optimizer.step()
            total[0] += loss.item()
        seconds = time.perf_counter() - start
        model.eval()
        with torch.no_grad():
            total[1] = (model(X_test).argmax(1) == y_test).sum().item()
        total[2] = len(y_test)
        dist.all_reduce(total)  # sums over ranks
        if rank == 0:
            print(f"epoch {epoch:2d}  loss {total[0] / (steps * size):.4f}  test accuracy {total[1] / total[2]:.3f}  "
                  f"{steps * args.batch_size * size / seconds:.0f} samples/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
