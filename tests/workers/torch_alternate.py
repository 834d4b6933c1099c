"""DistributedOptimizer over a model whose trainable parameters alternate between a few sets (requires_grad toggled
every step or two: a GAN's two sub-networks under one optimizer, a fine-tuning schedule), each run equal to one
process on the whole batch (every rank computes the reference, float64): the parameters, the gradients as torch
leaves them (None, or a frozen parameter's zeroed one with set_to_none=False), the momentum buffers. Each change laid
the buckets out anew (a first step again, every gradient out of its bucket): now a set seen before takes its kept
layout up, and ``opt._aiacc_rebuilds`` counts the layouts made anew: one per set. A rank that alone
goes back to a set seen before: an error on every rank naming the ranks, at once. Also (a guard of what a kept layout
must bring back with it): a sparse embedding (out of the buckets) with set_to_none=False, overlap_forward, and
backward_passes_per_step=2 with the sets toggled between the two passes."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import aiacc.torch as hvd
from one_process import Checks
from report import raises, say

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
B = 12  # rows per global batch: even shards on 2 or 3 ranks
checks = Checks(hvd, B)
shard, same = checks.shard, checks.same


class Net(nn.Module):
    def __init__(self, sparse=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 6, sparse=True) if sparse else None  # (trains with a)
        self.a = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
        self.b = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.b(self.a(x if self.emb is None else self.emb(x))))


def toggle(model, sets):
    for name in ("a", "b", "head", "emb"):
        if getattr(model, name) is not None:
            getattr(model, name).requires_grad_((name if name != "emb" else "a") in sets)


def trained(kind, trains, steps=8, set_to_none=True, dist=True, passes=1, overlap=False, sparse=False):
    """``steps`` steps, ``trains(step)`` the sub-networks trainable in each (with ``passes``: the next step's from
    the second pass on); returns the parameters, the gradients (zeros where None), which are None, the optimizer's
    state tensors; and the layouts made anew."""
    model = Net(sparse).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01) if kind == "sgd" else \
        torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.01) if kind == "adam" else \
        torch.optim.SGD(model.parameters(), lr=0.1)  # ("sparse": torch's SGD takes no weight decay of sparse ones)
    if dist:
        tag = f"alt{kind}{int(set_to_none)}{''.join(trains(1))}{passes}{int(overlap)}{int(sparse)}"
        opt = hvd.DistributedOptimizer(opt, named_parameters=[(f"{tag}.{k}", p) for k, p in model.named_parameters()],
                                       backward_passes_per_step=passes, overlap_forward=overlap)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        toggle(model, trains(step))
        opt.zero_grad(set_to_none=set_to_none)
        for k in range(passes):
            if k:
                toggle(model, trains(step + 1))
            x = torch.randint(0, 10, (B,), generator=g) if sparse else torch.randn(B, 6, generator=g, dtype=torch.float64)
            y = torch.randn(B, 3, generator=g, dtype=torch.float64)
            F.mse_loss(model(x[shard(dist)]), y[shard(dist)]).backward()
        opt.step()
    params = list(model.parameters())
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.to_dense().clone() for p in params]
    nones = [torch.tensor([float(p.grad is None)]) for p in params]
    state = [v.clone() for p in params for v in opt.state.get(p, {}).values() if torch.is_tensor(v) and v.dim()]
    rebuilds = opt._aiacc_rebuilds if dist else None
    if dist:
        opt.remove_hooks()
    return [p.detach().clone() for p in params] + grads + nones + state, rebuilds


def gan(step):  # one sub-network, then the other (the head trains with both)
    return ("a", "head") if step % 2 == 0 else ("b", "head")


def schedule(step):  # the head alone two steps, then everything two steps
    return ("head",) if step % 4 < 2 else ("a", "b", "head")


def three(step):  # three sets in turn
    return (("a",), ("b",), ("a", "b", "head"))[step % 3]


RUNS = [(kind, what, trains, set_to_none, {}) for kind in ("sgd", "adam") for what, trains, set_to_none in (
    ("GAN-style alternation", gan, True), ("GAN-style alternation", gan, False),
    ("fine-tuning schedule", schedule, True), ("three sets in turn", three, True))]
# guards: what a kept layout brings back (the sparse gradient out of the buckets, the deferred updates, pass counts)
RUNS += [("sparse" if kw.get("sparse") else "sgd", f"GAN-style alternation, {guard}", gan, False, kw) for kw, guard in (
    (dict(sparse=True), "a sparse embedding"), (dict(overlap=True), "overlap_forward"),
    (dict(passes=2), "backward_passes_per_step=2, toggled between the passes"))]
for kind, what, trains, set_to_none, more in RUNS:
    got, rebuilds = trained(kind, trains, set_to_none=set_to_none, **more)
    want, _ = trained(kind, trains, set_to_none=set_to_none, dist=False, **more)
    same(f"{what}, {kind}, set_to_none={set_to_none}", got, want)
    # one layout made anew per set other than the one at wrapping (every parameter); each change made one
    # before: 8, 4 and 8 in 8 steps
    sets = len({trains(step) for step in range(8)} - {("a", "b", "head")})
    assert rebuilds == sets, f"{what}, {kind}: {rebuilds} bucket layouts made anew for {sets} sets"
    checks.count += 1
say(f"ALTERNATE rank={r}")


def alone():
    """Rank 0 alone goes back to the set it trained two steps before (a layout kept): every rank's step() raises."""
    model = Net().double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=[(f"alone.{k}", p) for k, p in model.named_parameters()])
    g = torch.Generator().manual_seed(3)
    try:
        for step in range(5):
            trains = gan(step) if step < 3 or r == 0 else gan(step - 1)  # (the others stay with step 2's)
            for name in ("a", "b", "head"):
                getattr(model, name).requires_grad_(name in trains)
            opt.zero_grad()
            x = torch.randn(B, 6, generator=g, dtype=torch.float64)
            y = torch.randn(B, 3, generator=g, dtype=torch.float64)
            F.mse_loss(model(x[shard(True)]), y[shard(True)]).backward()
            opt.step()
    finally:
        opt.remove_hooks()


others = "rank 1" if n == 2 else "ranks " + ",".join(str(k) for k in range(1, n))
say(f"ERROR-SEEN rank={r}: " + raises(hvd.TensorMismatchError, alone, "rank 0 changed the gradients it averages",
                                      f"and {others} did not", "requires_grad"))
checks.count += 1
# and the job goes on: the same collectives on every rank
same("after the error", [hvd.allreduce(torch.full((2,), float(r), dtype=torch.float64), op=hvd.Sum, name="after")],
     [torch.full((2,), float(sum(range(n))), dtype=torch.float64)])
say(f"OK rank={r} checks={checks.count}")
