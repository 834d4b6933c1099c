"""overlap_forward and code that reads or changes parameters between ``step()`` and the next forward, each against
one process on the whole batch (float64, every rank computes the reference): weight clipping as in WGAN, a
hand-made weight decay and an EMA of the parameters after ``opt.synchronize()`` (the recipe the README gives: it
applies the pending updates), reads that apply them themselves (``torch.save(model.state_dict())``, an evaluation
under ``torch.no_grad()``, ``load_state_dict`` into another model), and GradScaler's recipe with a skipped
(overflowing) step. A parameter changed in place under ``torch.no_grad()`` without ``synchronize()`` was clipped
before its update and the update added after (silently other numbers): now an error naming it."""

import io

import torch
import torch.nn as nn
import torch.nn.functional as F

import aiacc.torch as hvd
from one_process import Checks
from report import say

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
B = 8
checks = Checks(hvd, B)
shard, same = checks.shard, checks.same


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def train(tag, dist, after_step, scaler=False, sync=True, steps=5):
    """``steps`` SGD steps; ``after_step(step, model, seen)`` runs between ``step()`` and the next forward (after
    ``opt.synchronize()`` when ``sync``) and may append what it reads to ``seen``."""
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if dist:
        opt = hvd.DistributedOptimizer(opt, overlap_forward=True,
                                       named_parameters=[(f"{tag}.{k}", p) for k, p in model.named_parameters()])
    amp = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaler else None
    g = torch.Generator().manual_seed(1)
    seen = []
    for step in range(steps):
        x, y = torch.randn(B, 6, generator=g, dtype=torch.float64), torch.randn(B, 3, generator=g, dtype=torch.float64)
        if scaler and step == 2:
            x[0, 0] = float("inf")  # (rank 0's rows) an overflow: every rank skips this step, as one process does
        opt.zero_grad()
        loss = F.mse_loss(model(x[shard(dist)]), y[shard(dist)])
        if amp is not None:
            amp.scale(loss).backward()
            amp.step(opt)
            amp.update()
        else:
            loss.backward()
            opt.step()
        if dist and sync:
            opt.synchronize()
        after_step(step, model, seen)
    if dist:
        opt.synchronize()
        opt.remove_hooks()
    return [p.detach().clone() for p in model.parameters()] + seen


def clip(step, model, seen):  # WGAN's critic
    for p in model.parameters():
        p.data.clamp_(-0.2, 0.2)


def decay(step, model, seen):  # weight decay by hand, as older scripts do it
    for p in model.parameters():
        p.data.mul_(0.9)


def ema(step, model, seen):
    if not seen:
        seen.extend(p.detach().clone() for p in model.parameters())
    for avg, p in zip(seen, model.parameters()):
        avg.mul_(0.5).add_(p.detach(), alpha=0.5)


def save_eval_load(step, model, seen):  # each applies the pending updates itself (no synchronize() needed)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    seen.extend(torch.load(buf).values())
    model.eval()
    with torch.no_grad():
        seen.append(model(torch.ones(2, 6, dtype=torch.float64)))
    model.train()
    other = net()
    other.load_state_dict(model.state_dict())
    seen.extend(p.detach().clone() for p in other.parameters())


def nothing(step, model, seen):
    pass


for what, after_step, kw in [("clip", clip, {}), ("decay", decay, {}), ("ema", ema, {}),
                             ("reads", save_eval_load, {"sync": False}), ("scaler", nothing, {"scaler": True}),
                             ("scaler.clip", clip, {"scaler": True})]:
    same(what, train(what, True, after_step, **kw), train(what, False, after_step, **kw))


# without synchronize(): a parameter changed in place (its version counter moved) is refused at its deferred
# update, naming it (the change was made to the value before the update: it was silently applied in reverse order)
def clip_no_grad(step, model, seen):
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.2, 0.2)


try:
    train("unsynced", True, clip_no_grad, sync=False)
except RuntimeError as exc:
    assert "parameter 'unsynced.0.weight' was changed in place after step()" in str(exc), exc
    assert "optimizer.synchronize()" in str(exc), exc
    say(f"ERROR-SEEN rank={r}: {exc}")
else:
    raise AssertionError("a parameter clipped in place before its deferred update was not refused")
say(f"OK rank={r} checks={checks.count}")
