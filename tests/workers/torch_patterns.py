"""DistributedOptimizer under training patterns users write, each equal to one process on the whole batch (every
rank computes the reference, float64): a parameter frozen mid-training and unfrozen later, a branch no rank takes in
some steps (no momentum, weight decay or Adam step moves a parameter whose gradient is None on every rank, as in one
process: they moved, as under Horovod)."""

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt

import aiacc.torch as hvd
from report import say

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
B = 12  # rows per global batch: even shards on 2 or 3 ranks
checks = 0


def shard(dist):
    return slice(r * B // n, (r + 1) * B // n) if dist else slice(0, B)


def same(what, got, want, tol=1e-12):
    global checks
    worst = max(float((a - b).abs().max()) for a, b in zip(got, want))
    assert worst <= tol, f"rank {r}: {what}: {worst:.3g} from the one-process reference"
    everyone = hvd.allgather_object(got)
    assert all(torch.equal(a, b) for theirs in everyone for a, b in zip(theirs, everyone[0])), f"{what}: ranks differ"
    checks += 1


def optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.Adam(params, lr=0.01)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.branch, self.out = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)


def train(what, dist, kind, before_step, forward, steps=6, set_to_none=True):
    """``steps`` steps of Net; ``before_step(step, model)`` runs after zero_grad, ``forward(step, model, x)``."""
    model = Net().double()
    opt = optimizer(kind, model.parameters())
    if dist:
        opt = hvd.DistributedOptimizer(opt, named_parameters=[(f"{what}.{k}", p) for k, p in model.named_parameters()])
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(B, 6, generator=g, dtype=torch.float64), torch.randn(B, 3, generator=g, dtype=torch.float64)
        opt.zero_grad(set_to_none=set_to_none)
        before_step(step, model)
        F.mse_loss(forward(step, model, x[shard(dist)]), y[shard(dist)]).backward()
        opt.step()
    if dist:
        opt.remove_hooks()
    return [p.detach().clone() for p in model.parameters()]


def freeze_2_to_4(step, model):
    model.a.weight.requires_grad_(not 2 <= step < 4)


def unused_in_odd_steps(step, model, x):  # also in the very first step: no rank has its gradient before the buckets
    h = torch.tanh(model.a(x))
    return model.out(h + model.branch(h) if step % 2 else h)


def plain(step, model, x):
    return model.out(torch.tanh(model.a(x)) + model.branch(x))


for kind in ("sgd", "adam"):
    for set_to_none in (True, False):  # (False: torch steps a zeroed gradient; a None one it skips)
        for what, before, forward in (("frozen", freeze_2_to_4, plain),
                                      ("unused", lambda step, model: None, unused_in_odd_steps)):
            tag = f"{what}.{kind}.{int(set_to_none)}"
            same(f"{what} ({kind}, set_to_none={set_to_none})",
                 train(tag, True, kind, before, forward, set_to_none=set_to_none),
                 train(tag, False, kind, before, forward, set_to_none=set_to_none))
say(f"OK rank={r} checks={checks}")
