"""DistributedOptimizer(op=Adasum), 2 ranks, gradients zeroed in place (``zero_grad(set_to_none=False)``, older
scripts' and some libraries' default) or changed in place between backward and step(), against a replay of both
ranks in this process (plain torch, each rank's own model and optimizer; at each step() every rank's optimizer steps
on its own gradients from the synchronized parameters and each parameter moves to start + the Adasum of the ranks'
changes). Each loop also runs with set_to_none=True, against the same replay:

- ``opt.zero_grad(set_to_none=False)`` each step, backward, step (backward_passes_per_step 1 and 2);
- ``opt.zero_grad(set_to_none=False)`` between backward and step() and a new backward (the deltas sent dropped);
- ``model.zero_grad(set_to_none=False)`` between backward and a new backward (a GAN's ``netD.zero_grad()`` in older
  scripts): was "computed more than backward_passes_per_step" on the next backward;
- ``model.zero_grad(set_to_none=False)`` then step() at once, in the last step (torch steps the zeros: the momentum
  moves the parameters);
  and ``clip_grad_norm_`` between backward and step(): step() applied the deltas of the gradients as they were at
  backward, silently.

- gradients changed in place without a new version: ``p.grad.data.clamp_(...)`` (older scripts' clipping) and a
  GradScaler's ``unscale_`` (``scaler.step(opt)``): step() applied the deltas of the gradients as backward left
  them (the scaled ones), silently; and ``clip_grad_norm_`` under SGD(nesterov, foreach), whose local step changes
  the gradient in place: the step begun again stepped on the changed one;
- a model whose gradients autograd makes as views of one tensor (``torch.cat`` of parameters), zeroed in place:
  accumulating one bumped the version counter the others share, and every step was sent twice. A plain loop
  (SGD with momentum and weight decay, foreach, nesterov; Adam with weight decay) begins no step again
  (``opt._aiacc_discards`` is 0).

Also the Average DistributedOptimizer with ``opt.zero_grad(set_to_none=False)``, against one process on the whole
batch.
"""

import torch
from torch import nn

import aiacc.torch as hvd
from report import say
from torch_adasum_ref import adasum_steps

torch.manual_seed(0)
torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
assert n == 2
checks = 0
B = 8  # rows of a whole batch; each rank takes B // n


class Cat(nn.Module):  # (the gradients of w1 and w2: views of the gradient of their torch.cat)
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(2, 4))
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        return self.head(torch.tanh(x @ torch.cat([self.w1, self.w2]).t()))


def new_model(arch="seq"):
    torch.manual_seed(0)
    return (Cat() if arch == "cat" else nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))).double()


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.05),
    "sgd_wd_foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=True),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, foreach=True),
    "adam_wd": lambda ps: torch.optim.Adam(ps, lr=0.05, weight_decay=0.01, foreach=True),
}


def train(dist, style, set_to_none, passes=1, kind="sgd", steps=3, arch="seq"):
    """This rank's parameters after ``steps`` steps of loop ``style`` (``dist``), or rank 0's in the replay; and the
    steps begun again (dist)."""
    ranks = [r] if dist else list(range(n))
    worlds = []
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) for _ in ranks]
    for k in ranks:
        model = new_model(arch)
        opt = OPTIMIZERS[kind](model.parameters())
        if dist:
            tag = f"{style}.{kind}.{int(set_to_none)}.{passes}.{arch}"
            opt = hvd.DistributedOptimizer(opt, op=hvd.Adasum, backward_passes_per_step=passes,
                                           named_parameters=[(f"{tag}.{name}", p) for name, p in model.named_parameters()])
        worlds.append((k, model, opt))
    g = torch.Generator().manual_seed(7)

    def backward(k, model, x, y):
        rows = slice(k * B // n, (k + 1) * B // n)
        loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        (scalers[ranks.index(k)].scale(loss) if style == "scaler" else loss).backward()

    for step in range(steps):
        for k, model, opt in worlds:
            opt.zero_grad(set_to_none=set_to_none)
        for _ in range(passes):
            x, y = torch.randn(B, 4, generator=g, dtype=torch.float64), torch.randn(B, 2, generator=g, dtype=torch.float64)
            for k, model, opt in worlds:
                backward(k, model, x, y)
        if style in ("opt_again", "model_again"):  # thrown away, then a new backward
            x, y = torch.randn(B, 4, generator=g, dtype=torch.float64), torch.randn(B, 2, generator=g, dtype=torch.float64)
            for k, model, opt in worlds:
                (opt if style == "opt_again" else model).zero_grad(set_to_none=set_to_none)
                backward(k, model, x, y)
        for k, model, opt in worlds:
            if style == "model_step" and step == steps - 1:  # (the momentum of the steps before moves them)
                model.zero_grad(set_to_none=set_to_none)
            if style == "clip":
                nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            if style == "clamp_data":  # (.data: no new version)
                for p in model.parameters():
                    p.grad.data.clamp_(-0.02, 0.02)
        if dist and style == "scaler":  # (unscale_ changes the gradients: no new version either)
            scalers[0].step(worlds[0][2])
        elif dist:
            worlds[0][2].step()
        else:
            for scaler, (k, model, opt) in zip(scalers, worlds):
                if style == "scaler":
                    scaler.unscale_(opt)
            adasum_steps([w[2] for w in worlds])
        if style == "scaler":
            for scaler in scalers:
                scaler.update()
    return [p.detach().clone() for p in worlds[0][1].parameters()], worlds[0][2]._aiacc_discards if dist else None


def same(what, got, want, arch="seq"):
    global checks
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-12), f"{what}: parameter {i}: {a} != {b}"
    # (the check proves something: the parameters trained)
    assert any(not torch.equal(a, b) for a, b in zip(got, new_model(arch).parameters())), f"{what}: nothing moved"
    checks += 1


for set_to_none in (False, True):
    for style, passes, kind in [("plain", 1, "sgd"), ("plain", 2, "sgd"), ("plain", 1, "adam"), ("opt_again", 1, "sgd"),
                                ("opt_again", 2, "adam"), ("model_again", 1, "sgd"), ("model_again", 2, "sgd"),
                                ("model_again", 1, "adam"), ("model_step", 1, "sgd"), ("clip", 1, "sgd")]:
        what = f"Adasum {style}, {kind}, set_to_none={set_to_none}, backward_passes_per_step={passes}"
        same(what, train(True, style, set_to_none, passes, kind)[0], train(False, style, set_to_none, passes, kind)[0])
    say(f"ADASUM set_to_none={set_to_none} rank={r}")

# changed in place without a new version; the optimizer's own in-place change; views of one gradient
for style, passes, kind, arch in [("clamp_data", 1, "sgd", "seq"), ("scaler", 1, "sgd", "seq"),
                                  ("scaler", 2, "adam_wd", "seq"), ("clip", 1, "sgd_nesterov", "seq"),
                                  ("plain", 1, "sgd_wd_foreach", "cat"), ("plain", 2, "sgd_nesterov", "cat"),
                                  ("plain", 1, "adam_wd", "cat"), ("plain", 1, "sgd_wd_foreach", "seq")]:
    what = f"Adasum {style}, {kind}, {arch}, set_to_none=False, backward_passes_per_step={passes}"
    (got, discards), (want, _) = (train(dist, style, False, passes, kind, arch=arch) for dist in (True, False))
    same(what, got, want, arch)
    assert style != "plain" or discards == 0, f"{what}: {discards} steps begun again (the work sent twice)"
say(f"ADASUM unseen rank={r}")


# the Average DistributedOptimizer, opt.zero_grad(set_to_none=False): one process on the whole batch
def average(dist):
    model = new_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if dist:
        opt = hvd.DistributedOptimizer(opt, named_parameters=[(f"avg.{name}", p) for name, p in model.named_parameters()])
    g = torch.Generator().manual_seed(8)
    rows = slice(r * B // n, (r + 1) * B // n) if dist else slice(0, B)
    for _ in range(3):
        opt.zero_grad(set_to_none=False)
        x, y = torch.randn(B, 4, generator=g, dtype=torch.float64), torch.randn(B, 2, generator=g, dtype=torch.float64)
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
    if dist:
        opt.remove_hooks()
    return [p.detach().clone() for p in model.parameters()]


same("Average, set_to_none=False", average(True), average(False))
hvd.shutdown()
say(f"OK rank={r} checks={checks}")
