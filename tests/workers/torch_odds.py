"""Two DistributedOptimizer cases that differed from one process (2 ranks; every rank computes the reference).

Sparse-gradient embeddings (``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True``) that no rank uses in some
steps (from the first step on, or after it), or that only rank 0 uses, under SGD with momentum, Adagrad with
lr_decay and SparseAdam, with and without sparse_as_dense and set_to_none, each equal to one process on the whole
batch (float64): a sparse gradient that is None on every rank stays None, so the optimizer skips its parameter as
in one process (an empty one was stepped: the momentum and Adagrad's and SparseAdam's step counts moved).

DistributedOptimizer(op=Adasum) in a GAN's loop that throws the discriminator's gradients from the generator's
backward away (netD.zero_grad() then a new backward, or optD.zero_grad(); refused before, as Horovod refuses the
second), and gradients set to None or by hand between backward and step() (the changes sent from the old ones
were applied), equal to a replay of both ranks with plain torch and Adasum's formula in numpy."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import aiacc.torch as hvd
from one_process import Checks
from report import say
from torch_adasum_ref import adasum_steps

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
B, V = 12, 10  # rows per global batch (even shards on 2 or 3 ranks), vocabulary
checks = Checks(hvd, B)


shard, same = checks.shard, checks.same


class Sparse(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.out = nn.Linear(3, 4), nn.Linear(4, 1)
        self.emb, self.bag = nn.Embedding(V, 4, sparse=True), nn.EmbeddingBag(V, 4, sparse=True)

    def forward(self, step, mode, x, idx, first):
        """``first``: the global index of this batch's first row. ``mode`` "none": the embedding unused in even
        steps (the first too), the bag in steps 1, 4; "some": each used only on the rows of rank 0's shard in odd
        steps (not at all on the other ranks); "first": the embedding unused in step 0, used on rank 0's rows only
        in step 1, on every rank after; the bag likewise a step later (each leaves the dense bucket in its own step);
        "zero": as "first", and the embedding's lookups of two rows in three of the batch weigh 0 (their rows are in
        the sparse gradient with zeros, which SparseAdam steps)."""
        h = self.lin(x)
        use_emb = use_bag = slice(None)
        rank0 = max(0, min(len(x), B // n - first))
        rank0 = slice(0, rank0) if rank0 else None
        if mode in ("first", "zero"):
            use_emb = {0: None, 1: rank0}.get(step, use_emb)
            use_bag = {0: None, 1: None, 2: rank0}.get(step, use_bag)
        elif mode == "none":
            use_emb = None if step % 2 == 0 else use_emb
            use_bag = None if step % 3 == 1 else use_bag
        elif mode == "late":
            use_emb = None if step % 2 else use_emb
            use_bag = None if step % 3 == 1 else use_bag
        elif step % 2:
            rows = max(0, min(len(x), B // n - first))
            use_emb = use_bag = slice(0, rows) if rows else None
        parts = []
        if use_emb is not None:
            looked = self.emb(idx[use_emb])
            if mode == "zero":
                weight = (torch.arange(first, first + len(x))[use_emb] % 3 == 0).to(looked.dtype)
                looked = looked * weight[:, None, None]
            parts.append(looked.sum(1))
        if use_bag is not None:
            parts.append(self.bag(idx[use_bag]))
        for part in parts:
            h = h + F.pad(part, (0, 0, 0, len(x) - len(part)))
        return self.out(torch.tanh(h))


def optimizers(kind, model):
    sparse = [model.emb.weight, model.bag.weight]
    dense = [p for p in model.parameters() if all(p is not q for q in sparse)]
    if kind == "sgd":
        return [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)]
    if kind == "adagrad":
        return [torch.optim.Adagrad(model.parameters(), lr=0.1, lr_decay=0.5)]
    return [torch.optim.SparseAdam(sparse, lr=0.05), torch.optim.Adam(dense, lr=0.01)]


def train(tag, dist, kind, mode, as_dense, set_to_none=True, steps=6, overlap=False):
    model = Sparse().double()
    opts = optimizers(kind, model)
    names = {p: k for k, p in model.named_parameters()}
    if dist:
        opts = [hvd.DistributedOptimizer(o, sparse_as_dense=as_dense, overlap_forward=overlap, named_parameters=[
            (f"{tag}.{names[p]}", p) for group in o.param_groups for p in group["params"]]) for o in opts]
    g = torch.Generator().manual_seed(1)
    try:
        for step in range(steps):
            x = torch.randn(B, 3, generator=g, dtype=torch.float64)
            idx = torch.randint(0, V, (B, 3), generator=g)
            y = torch.randn(B, 1, generator=g, dtype=torch.float64)
            for o in opts:
                o.zero_grad(set_to_none=set_to_none)
            rows = shard(dist)
            F.mse_loss(model(step, mode, x[rows], idx[rows], rows.start), y[rows]).backward()
            for o in opts:
                o.step()
        if dist:  # every rank has had a sparse gradient for both by now: in no dense bucket (reduced as sparse ones)
            bucketed = [label for o in opts for b in o._aiacc_buckets.describe() for label in b]
            assert not [x for x in bucketed if ".emb." in x or ".bag." in x], f"rank {r}: {tag}: {bucketed}"
    finally:
        if dist:
            for o in opts:
                o.remove_hooks()
    return [p.detach().clone() for p in model.parameters()]


for kind in ("sgd", "adagrad", "sparseadam"):
    # ("none" and "first": an embedding no rank uses in the first step goes in a dense bucket, and leaves it for good
    # once a rank has a sparse gradient for it; SparseAdam refused the dense gradients it got before)
    for mode in ("late", "none", "some", "first"):
        for as_dense in (False, True):
            for set_to_none in (True, False):  # (False: torch steps the emptied gradient; a None one it skips)
                tag = f"{kind}.{mode}.{int(as_dense)}.{int(set_to_none)}"
                same(f"sparse {tag}", train(tag, True, kind, mode, as_dense, set_to_none),
                     train(tag, False, kind, mode, as_dense, set_to_none))
for as_dense in (False, True):  # with overlap_forward the buckets are waited for one by one, in the next forward
    tag = f"sparseadam.first.{int(as_dense)}.overlap"
    same(f"sparse {tag}", train(tag, True, "sparseadam", "first", as_dense, overlap=True),
         train(tag, False, "sparseadam", "first", as_dense))


def zero_rows():
    """In one process, the rows of the embedding's gradient in the "zero" mode that are in it with zeros."""
    model, g, count = Sparse().double(), torch.Generator().manual_seed(1), 0
    for step in range(6):
        x, idx = torch.randn(B, 3, generator=g, dtype=torch.float64), torch.randint(0, V, (B, 3), generator=g)
        torch.randn(B, 1, generator=g)
        model.zero_grad()
        model(step, "zero", x, idx, 0).sum().backward()
        if model.emb.weight.grad is not None:
            values = model.emb.weight.grad.coalesce().values()
            count += int((values.abs().sum(1) == 0).sum())
    return count


# SparseAdam steps a row that is in the sparse gradient with zeros (its moments decay): the switching step's
# gradient has the rows each rank looked up, not the nonzero rows of a densified sum
assert zero_rows() > 0, "the zero mode has no rows with zero gradients: it tests nothing"
for overlap in (False, True):
    tag = f"sparseadam.zero.{int(overlap)}"
    same(f"sparse {tag}", train(tag, True, "sparseadam", "zero", False, overlap=overlap),
         train(tag, False, "sparseadam", "zero", False))
say(f"SPARSE rank={r}")


# DistributedOptimizer(op=Adasum) in a GAN's loop whose generator backward computes the discriminator's gradients
# too, thrown away before the discriminator's own backward (netD.zero_grad() or optD.zero_grad()), or the
# discriminator frozen then. The reference replays every rank here (plain torch, each rank's own models and
# optimizers, thrown-away gradients simply gone): at each step() every rank's optimizer steps on its own gradients
# from the synchronized parameters, and each parameter moves to start + the Adasum of the ranks' changes.
def adasum_gan(dist, style, g_first=False):
    ranks = [r] if dist else list(range(n))
    worlds = []
    for k in ranks:
        torch.manual_seed(0)
        gen = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6)).double()
        disc = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).double()
        opt_g = torch.optim.Adam(gen.parameters(), lr=0.01)
        opt_d = torch.optim.SGD(disc.parameters(), lr=0.05, momentum=0.9)
        if dist:
            tag = f"adasum.{style}{int(g_first)}"
            opt_g = hvd.DistributedOptimizer(opt_g, op=hvd.Adasum, named_parameters=[
                (f"{tag}.g.{name}", p) for name, p in gen.named_parameters()])
            opt_d = hvd.DistributedOptimizer(opt_d, op=hvd.Adasum, named_parameters=[
                (f"{tag}.d.{name}", p) for name, p in disc.named_parameters()])
        worlds.append((k, gen, disc, opt_g, opt_d))
    g = torch.Generator().manual_seed(4)

    def rows(k):
        return slice(k * B // n, (k + 1) * B // n)

    def step(opts):
        if dist:
            opts[0].step()
        else:
            adasum_steps(opts)

    def d_step(fakes, real):
        for (k, gen, disc, opt_g, opt_d), fake in zip(worlds, fakes):
            disc.zero_grad() if style == "dcgan" else opt_d.zero_grad()
            disc.requires_grad_(True)
            (F.softplus(-disc(real[rows(k)])).mean() + F.softplus(disc(fake.detach())).mean()).backward()
        step([w[4] for w in worlds])

    def g_step(fakes):
        for (k, gen, disc, opt_g, opt_d), fake in zip(worlds, fakes):
            gen.zero_grad() if style == "dcgan" else opt_g.zero_grad()
            disc.requires_grad_(style != "frozen")
            F.softplus(-disc(fake)).mean().backward()
        step([w[3] for w in worlds])

    for _ in range(4):
        z = torch.randn(B, 4, generator=g, dtype=torch.float64)
        real = torch.randn(B, 6, generator=g, dtype=torch.float64)
        fakes = [gen(z[rows(k)]) for k, gen, *_ in worlds]
        if g_first:  # (the discriminator's very first gradients are thrown away: it has no optimizer state yet)
            g_step(fakes)
            d_step(fakes, real)
        else:
            d_step(fakes, real)
            g_step(fakes)
    _, gen, disc, *_ = worlds[0]
    return [p.detach().clone() for p in (*gen.parameters(), *disc.parameters())]


if n == 2:
    for style in ("dcgan", "opt_zero", "frozen"):
        same(f"Adasum GAN, {style}", adasum_gan(True, style), adasum_gan(False, style))
    same("Adasum GAN, dcgan, generator first", adasum_gan(True, "dcgan", True), adasum_gan(False, "dcgan", True))


# Adasum, gradients set to None after backward (model.zero_grad()) and one set by hand, then step(): the step takes
# the gradients as they are then, as in one process (the changes sent from the thrown-away ones were applied)
def adasum_replaced(dist):
    ranks = [r] if dist else list(range(n))
    worlds = []
    for k in ranks:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if dist:
            opt = hvd.DistributedOptimizer(opt, op=hvd.Adasum, named_parameters=[
                (f"replaced.{name}", p) for name, p in model.named_parameters()])
        worlds.append((k, model, opt))
    g = torch.Generator().manual_seed(5)
    for step in range(3):
        x = torch.randn(B, 4, generator=g, dtype=torch.float64)
        for k, model, opt in worlds:
            opt.zero_grad()
            model(x[k * B // n:(k + 1) * B // n]).square().mean().backward()
            if step == 1:
                model.zero_grad()
                model[2].weight.grad = torch.full_like(model[2].weight, k + 1.0)
        if dist:
            worlds[0][2].step()
        else:
            adasum_steps([w[2] for w in worlds])
    return [p.detach().clone() for p in worlds[0][1].parameters()]


if n == 2:
    same("Adasum, gradients set to None or by hand before step()", adasum_replaced(True), adasum_replaced(False))
say(f"OK rank={r} checks={checks.count}")
