"""DistributedOptimizer under training patterns users write, each equal to one process on the whole batch (every
rank computes the reference, float64): a parameter frozen mid-training and unfrozen later, param groups added
mid-training with ``add_param_group`` (progressive unfreezing), a branch no rank takes in
some steps (no momentum, weight decay or Adam step moves a parameter whose gradient is None on every rank, as in one
process: they moved, as under Horovod), a GAN's two optimizers stepped alternately whose generator backward computes
the discriminator's gradients too, thrown away by the loop (refused, or a misleading error), activation
checkpointing (reentrant or not) over tied weights and a layer applied twice, and gradients changed between
``synchronize()`` and ``step()`` under ``skip_synchronize()``."""

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt

import aiacc.torch as hvd
from one_process import Checks
from report import say

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
B = 12  # rows per global batch: even shards on 2 or 3 ranks
checks = Checks(hvd, B)


shard, same = checks.shard, checks.same


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
say(f"FROZEN rank={r}")


def added_group(dist, kind, overlap=False):
    """Progressive unfreezing as DDP users write it: ``a`` frozen and out of the optimizer, unfrozen at step 2 and
    added with ``add_param_group`` (a learning rate of its own); at step 3 a new parameter no name covers, in a group
    of its own. Refused at step() before (its gradients would not be averaged), or unaveraged under Horovod."""
    model = Net().double()
    model.a.requires_grad_(False)
    scale = nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = optimizer(kind, list(model.branch.parameters()) + list(model.out.parameters()))
    if dist:
        opt = hvd.DistributedOptimizer(opt, named_parameters=[(f"added{kind}{overlap}.{k}", p)
                                                              for k, p in model.named_parameters()],
                                       overlap_forward=overlap)
    g = torch.Generator().manual_seed(5)
    for step in range(5):
        if step == 2:
            model.a.requires_grad_(True)
            opt.add_param_group({"params": list(model.a.parameters()), "lr": 0.03})
        if step == 3 and not overlap:  # (overlap_forward updates parameters of modules only)
            opt.add_param_group({"params": [scale], "lr": 0.2})
        x, y = torch.randn(B, 6, generator=g, dtype=torch.float64), torch.randn(B, 3, generator=g, dtype=torch.float64)
        opt.zero_grad()
        F.mse_loss(plain(step, model, x[shard(dist)]) * scale, y[shard(dist)]).backward()
        opt.step()
    if dist:
        opt.remove_hooks()
    return [p.detach().clone() for p in model.parameters()] + [scale.detach().clone()]


for kind, overlap in (("sgd", False), ("adam", False), ("sgd", True)):
    same(f"add_param_group mid-training ({kind}, overlap_forward={overlap})", added_group(True, kind, overlap),
         added_group(False, kind, overlap))


# a GAN: two optimizers over disjoint parts, stepped alternately. The generator's backward goes through the
# discriminator and computes its gradients too (sent to the engine at once), which the loop throws away before the
# discriminator's own backward: netD.zero_grad() as torch's DCGAN example, or optD.zero_grad(); or the discriminator
# is frozen during the generator's step (CycleGAN's set_requires_grad)
def gan(dist, style, g_first=False):
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6)).double()
    disc = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    opt_g, opt_d = torch.optim.Adam(gen.parameters(), lr=0.01), torch.optim.SGD(disc.parameters(), lr=0.05, momentum=0.9)
    if dist:
        tag = f"{style}{int(g_first)}"
        opt_g = hvd.DistributedOptimizer(opt_g, named_parameters=[(f"{tag}.g.{k}", p) for k, p in gen.named_parameters()])
        opt_d = hvd.DistributedOptimizer(opt_d, named_parameters=[(f"{tag}.d.{k}", p) for k, p in disc.named_parameters()])
    g = torch.Generator().manual_seed(4)

    def d_step(fake, real):
        if style == "in_place":
            disc.zero_grad(set_to_none=False)
        else:
            disc.zero_grad() if style == "dcgan" else opt_d.zero_grad()
        disc.requires_grad_(True)
        (F.softplus(-disc(real)).mean() + F.softplus(disc(fake.detach())).mean()).backward()
        opt_d.step()

    def g_step(fake):
        gen.zero_grad() if style == "dcgan" else opt_g.zero_grad()
        disc.requires_grad_(style != "frozen")
        F.softplus(-disc(fake)).mean().backward()
        opt_g.step()

    try:
        for step in range(4):
            z = torch.randn(B, 4, generator=g, dtype=torch.float64)[shard(dist)]
            real = torch.randn(B, 6, generator=g, dtype=torch.float64)[shard(dist)]
            fake = gen(z)
            if g_first:  # (the discriminator's first gradients are thrown away before its buckets are settled)
                g_step(fake)
                d_step(fake, real)
            else:
                d_step(fake, real)
                g_step(fake)
    finally:
        if dist:
            opt_g.remove_hooks()
            opt_d.remove_hooks()
    return [p.detach().clone() for p in (*gen.parameters(), *disc.parameters())]


for style in ("dcgan", "opt_zero", "frozen"):
    same(f"GAN, {style}", gan(True, style), gan(False, style))
same("GAN, dcgan, generator first", gan(True, "dcgan", g_first=True), gan(False, "dcgan", g_first=True))
# zeroed in place while being averaged: each rank would average whatever it had then; refused, naming the fix
try:
    gan(True, "in_place")
    raise AssertionError("discriminator gradients zeroed in place while averaged: no error")
except RuntimeError as e:
    assert "'in_place0.d." in str(e) and "zeroed in place (model.zero_grad(set_to_none=False))" in str(e), e
    checks.count += 1
say(f"GAN rank={r}")

# only some of an optimizer's gradients thrown away after their backward (the last layer's, whose hook comes first in
# the next backward): the others, averaged meanwhile, count once (with op=Sum too, which had counted them n times)
def partial(dist, which, op):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if dist:
        opt = hvd.DistributedOptimizer(opt, op=op, named_parameters=[(f"partial{which}{op}.{k}", p)
                                                                     for k, p in model.named_parameters()])
    g = torch.Generator().manual_seed(1)
    # the reference: every rank's shard on its own, the losses averaged (or summed for op=Sum)
    shards = [shard(True)] if dist else [slice(k * B // n, (k + 1) * B // n) for k in range(n)]
    scale = 1.0 if dist or op == hvd.Sum else 1.0 / n
    for step in range(3):
        opt.zero_grad()
        x = torch.randn(B, 4, generator=g, dtype=torch.float64)
        for rows in shards:
            (model(x[rows]).square().mean() * scale).backward()
        model[which].zero_grad()
        for rows in shards:
            (model(2 * x[rows]).square().mean() * scale).backward()
        opt.step()
    if dist:
        opt.remove_hooks()
    return [p.detach().clone() for p in model.parameters()]


for op in (hvd.Average, hvd.Sum):
    same(f"the last layer's gradients thrown away, op={op}", partial(True, 2, op), partial(False, 2, op))
# the first layer's: the kept last layer's gradient is computed again first, into memory being averaged: refused
try:
    partial(True, 0, hvd.Average)
    raise AssertionError("gradients computed again into a bucket being averaged: no error")
except RuntimeError as e:
    assert "'partial0Average.2.bias' was computed again before step()" in str(e) and "'partial0Average.0.weight'" in str(e), e
    checks.count += 1


# activation checkpointing (reentrant or not) of blocks over an embedding tied to the output projection, with a
# layer applied twice in one forward (one gradient per backward, summed by autograd)
class Tied(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mid, self.head = nn.Embedding(10, 6), nn.Linear(6, 6), nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight
        self.reentrant = reentrant

    def block(self, h):
        return torch.tanh(self.mid(torch.tanh(self.mid(h))))

    def forward(self, idx):
        return self.head(ckpt.checkpoint(self.block, self.emb(idx), use_reentrant=self.reentrant))


def tied(dist, reentrant, kind):
    model = Tied(reentrant).double()
    opt = optimizer(kind, model.parameters())
    if dist:
        opt = hvd.DistributedOptimizer(opt, named_parameters=[(f"tied{reentrant}{kind}.{k}", p)
                                                              for k, p in model.named_parameters()])
    g = torch.Generator().manual_seed(3)
    for step in range(4):
        idx, target = torch.randint(0, 10, (B, 4), generator=g), torch.randint(0, 10, (B, 4), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(idx[shard(dist)]).reshape(-1, 10), target[shard(dist)].reshape(-1)).backward()
        if dist:  # Horovod's recipe for changing gradients before the update: synchronize(), change, skip_synchronize()
            opt.synchronize()
        model.mid.weight.grad.mul_(0.5)
        if dist:
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    if dist:
        opt.remove_hooks()
    return [p.detach().clone() for p in model.parameters()]


for reentrant in (False, True):
    for kind in ("sgd", "adam"):
        same(f"checkpoint(use_reentrant={reentrant}), tied weights, {kind}", tied(True, reentrant, kind),
             tied(False, reentrant, kind))
say(f"OK rank={r} checks={checks.count}")
