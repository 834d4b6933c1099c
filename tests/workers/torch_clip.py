"""Gradient clipping over ``model.parameters()`` with ``DistributedOptimizer``, each rank on its share of every batch:

* Horovod's recipe (``opt.synchronize()``, clip, ``with opt.skip_synchronize(): opt.step()``) and clipping through the
  optimizer (``opt.param_groups``, which waits for the averages first) equal one process that averages the ranks'
  gradients, then clips (``clip_grad_norm_`` and ``clip_grad_value_``);
* DDP's loop (``backward(); clip_grad_norm_(model.parameters()); step()``) changes gradients whose buckets are being
  averaged: a RuntimeError from the first step on (whose buckets ``step()`` sends, after the clip: each rank's
  clipped gradients averaged) naming the parameters and the recipe, on every rank, after which the optimizer goes on
  as the recipe; also where the bucket waits for ``step()`` (a parameter no rank uses), which averaged each rank's
  clipped gradients.
Prints ``OK rank=<r> checks=<n>``."""

import copy

import torch
import torch.nn as nn

import aiacc.torch as hvd
from report import raises, say

hvd.init()
torch.set_num_threads(1)
r, n = hvd.rank(), hvd.size()
torch.manual_seed(0)
BASE = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
X, Y = torch.randn(5, 4 * n, 8) * 3, torch.randint(0, 4, (5, 4 * n))
CLIPS = {"norm": lambda ps: nn.utils.clip_grad_norm_(ps, 0.05), "value": lambda ps: nn.utils.clip_grad_value_(ps, 0.01)}


def loss_of(model, step, k):
    rows = slice(k * 4, k * 4 + 4)
    return nn.functional.cross_entropy(model(X[step, rows]), Y[step, rows])


def reference(clip, steps):
    """One process: the ranks' gradients averaged, then clipped."""
    model = copy.deepcopy(BASE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for s in range(steps):
        grads = []
        for k in range(n):
            model.zero_grad()
            loss_of(model, s, k).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] for g in grads) / n
        clip(list(model.parameters()))
        opt.step()
    return model


def distributed():
    model = copy.deepcopy(BASE)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), bucket_cap_mb=0.0005)
    return model, opt


def same(a, b):
    return all(torch.allclose(p, q, rtol=1e-5, atol=1e-7) for p, q in zip(a.parameters(), b.parameters()))


checks = 0
for kind, clip in CLIPS.items():
    for how in ("recipe", "param_groups"):
        model, opt = distributed()
        for s in range(5):
            opt.zero_grad()
            loss_of(model, s, r).backward()
            if how == "recipe":
                opt.synchronize()
                clip(list(model.parameters()))
                with opt.skip_synchronize():
                    opt.step()
            else:
                clip([p for group in opt.param_groups for p in group["params"]])
                opt.step()
        assert same(model, reference(clip, 5)), (kind, how)
        checks += 1
        opt.remove_hooks()

    # DDP's loop: refused at the first step (whose buckets step() sends: each rank's clipped gradients averaged,
    # silently) and at any later one, whatever the timing; the optimizer goes on afterwards
    model, opt = distributed()
    opt.zero_grad()
    loss_of(model, 0, r).backward()
    clip(list(model.parameters()))
    raises(RuntimeError, opt.step, "the gradients of '0.weight', '0.bias', '2.weight', '2.bias', '4.weight' (and 1 "
           "more) were changed in place between backward() and step() while being averaged",
           "opt.synchronize(); torch.nn.utils.clip_grad_norm_(...)", "with opt.skip_synchronize(): opt.step()")
    opt.zero_grad()
    loss_of(model, 2, r).backward()
    opt.synchronize()
    clip(list(model.parameters()))
    with opt.skip_synchronize():
        opt.step()
    checks += 1
    opt.remove_hooks()


class Spare(nn.Module):
    """BASE with a layer no rank uses: the one bucket (the default cap) waits for step() at every step."""

    def __init__(self):
        super().__init__()
        self.net, self.spare = copy.deepcopy(BASE), nn.Linear(2, 2)

    def forward(self, x):
        return self.net(x)


# DDP's loop where the bucket is sent by step(), after the clip: each rank's clipped gradients were averaged, not the
# average clipped (no error: other numbers than one process, and than DDP's); refused as well, at the second step
model = Spare()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
for s in range(2):
    opt.zero_grad()
    loss_of(model, s, r).backward()
    if s == 0:
        opt.step()
    else:
        nn.utils.clip_grad_norm_(model.parameters(), 0.05)
raises(RuntimeError, opt.step, "the gradients of 'net.0.weight', 'net.0.bias', 'net.2.weight', 'net.2.bias', "
       "'net.4.weight' (and 1 more) were changed in place between backward() and step()", "and on the gradient buckets")
checks += 1
opt.remove_hooks()
say(f"OK rank={r} checks={checks}")
