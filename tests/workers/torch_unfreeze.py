"""DistributedOptimizer when the parameters it trains change between steps, each run equal to one process on the
whole batch (every rank computes the reference, float64): the fine-tuning recipe (an optimizer over every parameter,
the backbone frozen before wrapping or before the first step, unfrozen on every rank after some steps, frozen again),
with SGD with momentum and Adam, backward_passes_per_step=2 and overlap_forward; ``opt.param_groups = [...]``
assigned between steps. Each change to a set not seen before lays the buckets out again (the next step is a first
step: the bucket labels are the trainable parameters'); one seen before takes its kept layout up. Ranks that change at different points (one unfreezes, freezes or adds a group alone): an
error on every rank naming the ranks and the parameter, at once."""

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
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.backbone(x))


def optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.Adam(params, lr=0.01)


def labels(opt):
    return sorted(spec.label for spec in opt._aiacc_buckets.params)


BACKBONE = ["grad.{}.backbone.0.bias", "grad.{}.backbone.0.weight", "grad.{}.backbone.2.bias",
            "grad.{}.backbone.2.weight"]
HEAD = ["grad.{}.head.bias", "grad.{}.head.weight"]


def finetune(dist, kind, when="before wrapping", passes=1, overlap=False, steps=7):
    """Frozen backbone ``when``, unfrozen after step 1 (before the backward of step 2), frozen again after step 4."""
    model = Net().double()
    opt = optimizer(kind, model.parameters())
    tag = f"ft{kind}{when[:3]}{passes}{int(overlap)}"
    if when == "before wrapping":
        model.backbone.requires_grad_(False)
    if dist:
        opt = hvd.DistributedOptimizer(opt, named_parameters=[(f"{tag}.{k}", p) for k, p in model.named_parameters()],
                                       backward_passes_per_step=passes, overlap_forward=overlap)
    if when == "before the first step":
        model.backbone.requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        if step == 2:
            model.backbone.requires_grad_(True)
        if step == 5:
            model.backbone.requires_grad_(False)
        opt.zero_grad()
        for _ in range(passes):
            x = torch.randn(B, 6, generator=g, dtype=torch.float64)
            y = torch.randn(B, 3, generator=g, dtype=torch.float64)
            F.mse_loss(model(x[shard(dist)]), y[shard(dist)]).backward()
        opt.step()
        if dist:  # the buckets hold the trainable parameters' gradients from the step that saw the change on
            want = HEAD + BACKBONE if 2 <= step < 5 else HEAD
            assert labels(opt) == sorted(w.format(tag) for w in want), (step, labels(opt))
            # a first step again after the step that saw the change to a set not seen before (and only then: the
            # buckets stay settled); a set seen before takes its kept layout up (settled): the head alone at step 5,
            # and every parameter at step 2 when the backbone was frozen after wrapping (see regroup.py)
            changed = step == 2 and when == "before wrapping" or step == 0 and when == "before the first step"
            assert opt._aiacc_buckets.established != changed, (step, opt._aiacc_buckets.established)
    if dist:
        opt.synchronize()
        opt.remove_hooks()
    return [p.detach().clone() for p in model.parameters()]


for kind in ("sgd", "adam"):
    for when in ("before wrapping", "before the first step"):
        same(f"fine-tuning, frozen {when}, unfrozen, frozen again ({kind})", finetune(True, kind, when),
             finetune(False, kind, when))
    same(f"fine-tuning, backward_passes_per_step=2 ({kind})", finetune(True, kind, passes=2),
         finetune(False, kind, passes=2))
    same(f"fine-tuning, overlap_forward ({kind})", finetune(True, kind, overlap=True),
         finetune(False, kind, overlap=True))
say(f"FINETUNE rank={r}")


def assigned(dist, kind):
    """``opt.param_groups = [...]`` between steps: the backbone in a group of its own (a learning rate of its own)
    after step 1, then only the head after step 3."""
    model = Net().double()
    opt = optimizer(kind, model.head.parameters())
    if dist:
        opt = hvd.DistributedOptimizer(opt, named_parameters=[(f"pg{kind}.{k}", p)
                                                              for k, p in model.named_parameters()])
    g = torch.Generator().manual_seed(2)
    for step in range(5):
        if step == 2:
            opt.param_groups = [opt.param_groups[0], dict(opt.param_groups[0], params=list(model.backbone.parameters()),
                                                          lr=0.03)]
        if step == 4:
            opt.param_groups = opt.param_groups[:1]
        opt.zero_grad()
        x, y = torch.randn(B, 6, generator=g, dtype=torch.float64), torch.randn(B, 3, generator=g, dtype=torch.float64)
        F.mse_loss(model(x[shard(dist)]), y[shard(dist)]).backward()
        opt.step()
        if dist:
            want = HEAD + BACKBONE if 2 <= step < 4 else HEAD
            assert labels(opt) == sorted(w.format(f"pg{kind}") for w in want), (step, labels(opt))
    if dist:
        opt.remove_hooks()
    return [p.detach().clone() for p in model.parameters()]


for kind in ("sgd", "adam"):
    same(f"param_groups assigned between steps ({kind})", assigned(True, kind), assigned(False, kind))
# assigned after backward() and before step() with other parameters: refused, naming the gradients in flight
model = Net().double()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.head.parameters(), lr=0.1),
                               named_parameters=[(f"late.{k}", p) for k, p in model.named_parameters()])
model(torch.ones(2, 6, dtype=torch.float64)).sum().backward()
say(f"ERROR-SEEN rank={r}: assigned late: " + raises(
    RuntimeError, lambda: setattr(opt, "param_groups", [{"params": list(model.parameters()), "lr": 0.1}]),
    "DistributedOptimizer.param_groups was assigned after backward() and before step()", "'late.head.weight'"))
checks.count += 1
opt.step()
opt.remove_hooks()
say(f"ASSIGNED rank={r}")


def disagree(what):
    """Rank 0 alone changes the parameters after step 1: every rank's next step() raises, naming ranks and parameters;
    then each rank goes on (nothing is left in flight)."""
    model = Net().double()
    extra = nn.Parameter(torch.ones(3, dtype=torch.float64))
    if what in ("unfreezes", "adds a group before the first step"):
        model.backbone.requires_grad_(False)
    opt = optimizer("sgd", model.parameters())
    opt = hvd.DistributedOptimizer(opt, named_parameters=[(f"{what[:3]}.{k}", p) for k, p in model.named_parameters()])
    g = torch.Generator().manual_seed(3)

    def step(k):
        opt.zero_grad()
        x, y = torch.randn(B, 6, generator=g, dtype=torch.float64), torch.randn(B, 3, generator=g, dtype=torch.float64)
        F.mse_loss(model(x[shard(True)]) * extra, y[shard(True)]).backward()
        opt.step()

    first = {"adds a group before the first step": 0, "adds a group after the first step": 1}.get(what, 2)
    for k in range(first):
        step(k)
    try:
        if r == 0:
            if what == "unfreezes":
                model.backbone.requires_grad_(True)
            elif what == "freezes":
                model.backbone.requires_grad_(False)
            else:
                opt.add_param_group({"params": [extra]})
        step(first)
        step(first + 1)
    finally:
        opt.remove_hooks()


others = "rank 1" if n == 2 else "ranks " + ",".join(str(k) for k in range(1, n))
for what, words in (
        ("unfreezes", ["rank 0 changed the gradients it averages", f"and {others} did not",
                       "only rank 0 has 'grad.unf.backbone.0.weight'", "requires_grad"]),
        ("freezes", ["rank 0 changed the gradients it averages", f"and {others} did not",
                     f"only {others} ha", "'grad.fre.backbone.0.weight'"]),
        ("adds a group", ["rank 0 changed the gradients it averages", f"and {others} did not",
                          "only rank 0 has 'grad.added"]),
        ("adds a group before the first step", ["the number of gradients to average differs across ranks",
                                                "only rank 0 has 'grad.added"]),
        # (its regroup met the others' same-start check of the second step: they waited for each other until the
        # stall shutdown; now the check is made first, on every rank)
        ("adds a group after the first step", ["rank 0 changed the gradients it averages", f"and {others} did not",
                                               "only rank 0 has 'grad.added"])):
    say(f"ERROR-SEEN rank={r}: {what}: {raises(hvd.TensorMismatchError, lambda: disagree(what), *words)}")
    checks.count += 1
# and the job goes on: the same collectives on every rank
same("after the errors", [hvd.allreduce(torch.full((2,), float(r), dtype=torch.float64), op=hvd.Sum, name="after")],
     [torch.full((2,), float(sum(range(n))), dtype=torch.float64)])
say(f"OK rank={r} checks={checks.count}")
