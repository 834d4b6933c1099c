"""backward_passes_per_step=2 over epochs of 3 micro-batches: the last window of each epoch has one pass. Nothing is
handed over before the second pass, so reading opt.param_groups there had nothing to wait for: clipping through it
(the README's recipe, exact in full windows) clipped each rank's own gradient and step() averaged the clipped ones,
silently. Now step() refuses it on every rank, naming the gradients; Horovod's recipe (synchronize(), clip,
skip_synchronize() step) is exact there, and synchronize() then zero_grad() drops a partial window. GradScaler's
unscale_ ends the window: the averages are made first (it unscaled each rank's own, and an overflow on one rank had
that rank alone skip the step), so the PyTorch recipe (unscale_, clip model.parameters(), step) is exact, and every
rank skips an overflowing step together. Each result is compared with one process accumulating every rank's
micro-batches."""

import copy

import torch
import torch.nn as nn

import aiacc.torch as hvd
from report import raises, say

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
ref = copy.deepcopy(model)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), named_parameters=model.named_parameters(),
                               backward_passes_per_step=2)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
g = torch.Generator().manual_seed(1)
DATA = [(torch.randn(2 * n, 4, generator=g), torch.randn(2 * n, 2, generator=g)) for _ in range(3)]
checks = 0


scaler = torch.amp.GradScaler("cpu", init_scale=1.0)  # (1: the one process's gradients are the unscaled ones)


def backward(j, overflow=False):
    x, y = DATA[j]
    loss = nn.functional.mse_loss(model(x[2 * r:2 * r + 2]), y[2 * r:2 * r + 2])
    scaler.scale(loss * float("inf") if overflow and r == n - 1 else loss).backward()
    for q in range(n):  # one process: every rank's micro-batch, averaged over the ranks
        (nn.functional.mse_loss(ref(x[2 * q:2 * q + 2]), y[2 * q:2 * q + 2]) / n).backward()


def same(what):
    global checks
    err = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    assert err < 1e-6, f"{what} on rank {r}: max err {err}"
    checks += 1


def clip_through_param_groups():
    torch.nn.utils.clip_grad_norm_([p for group in opt.param_groups for p in group["params"]], 0.05)
    opt.step()


for epoch, last in enumerate(("param_groups", "horovod", "drop", "grad scaler", "overflow on the last rank")):
    for j in range(2):  # a full window: reading param_groups waits for the averages (the README's recipe)
        backward(j)
    clip_through_param_groups()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    ref_opt.step()
    opt.zero_grad()
    ref_opt.zero_grad()
    same(f"epoch {epoch}, full window")
    backward(2, overflow=last.startswith("overflow"))  # the last, partial window
    if last == "grad scaler":  # PyTorch's recipe: unscale_ (which averages first), clip, step
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        scaler.step(opt)
        scaler.update()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
    elif last.startswith("overflow"):  # every rank sees the average's infinity: all skip the step, and back off
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == 0.5, f"rank {r}: the scale is {scaler.get_scale()}: this rank did not skip"
    elif last == "param_groups":
        raises(RuntimeError, clip_through_param_groups, "'0.weight'", "changed in place between backward() and step() "
               "in a window of fewer than backward_passes_per_step", "opt.synchronize()")
    elif last == "horovod":
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        with opt.skip_synchronize():
            opt.step()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
    else:
        raises(RuntimeError, opt.zero_grad, "fewer than backward_passes_per_step=2", "to drop a last, partial window "
               "instead: synchronize(), then zero_grad()")
        opt.synchronize()
    opt.zero_grad()
    ref_opt.zero_grad()
    same(f"epoch {epoch}, partial window ({last})")
say(f"OK rank={r} checks={checks}")  # (2 per epoch)
