"""overlap_forward: deferred per-layer updates give exactly the results of the plain optimizer.

Two copies of a model train side by side on the same data (each rank on its shard): one with
DistributedOptimizer(overlap_forward=False), one with overlap_forward=True, under a learning-rate
scheduler that changes the lr every step. Parameters must be equal after every step (checked
after the next forward, and through state_dict()).
"""

import copy
import gc
import pickle
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import aiacc.torch as hvd
from report import say

hvd.init()
torch.set_num_threads(1)
r, n = hvd.rank(), hvd.size()


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Sequential(nn.Linear(4 * 8 * 8, 32), nn.ReLU()), nn.Linear(32, 10))


def train(kind: str, overlap: bool, steps: int = 8, zero_first: bool = True):
    model = make_model()
    base = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if kind == "sgd"
            else torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01) if kind == "adam-tensor-lr" else 0.01))
    opt = hvd.DistributedOptimizer(base, named_parameters=[(f"{kind}.{overlap}.{zero_first}.{k}", p)
                                                           for k, p in model.named_parameters()],
                                   overlap_forward=overlap)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    g = torch.Generator().manual_seed(1)
    history = []
    for step in range(steps):
        x = torch.randn(8 * n, 1, 8, 8, generator=g)[r * 8:(r + 1) * 8]
        y = torch.randint(0, 10, (8 * n,), generator=g)[r * 8:(r + 1) * 8]
        if zero_first:
            opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
        if not zero_first:
            opt.zero_grad()
        # state_dict() applies any deferred update before reading the parameters
        history.append({k: v.clone() for k, v in model.state_dict().items()})
    return model, opt, history


# (adam-tensor-lr: a tensor learning rate, which the scheduler changes in place after step(); the deferred updates
# used the next step's rate, the hyper-parameters remembered at step() holding the same tensor)
for kind in ("sgd", "adam", "adam-tensor-lr"):
    for zero_first in (True, False):
        _, _, plain = train(kind, False, zero_first=zero_first)
        model, opt, overlapped = train(kind, True, zero_first=zero_first)
        for step, (a, b) in enumerate(zip(plain, overlapped)):
            for k in a:
                assert torch.equal(a[k], b[k]), f"{kind} step {step} {k}: max diff {(a[k] - b[k]).abs().max()}"
        # parameters agree across ranks too
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        assert torch.equal(hvd.broadcast(flat, 0, name=f"check.{kind}.{zero_first}"), flat)

# a forward in eval mode applies pending updates, like any forward
model, opt, _ = train("sgd", True, steps=2)
x = torch.randn(2, 1, 8, 8)
with torch.no_grad():
    model.eval()
    model(x)
assert not opt._aiacc_sched.pending, "pending updates after a full forward"


# a module that reads a child's parameters itself (as nn.MultiheadAttention reads out_proj.weight):
# the child's update is applied before the parent's forward, and results equal the plain optimizer's
class Functional(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return F.linear(x, self.fc.weight, self.fc.bias)  # fc's own forward never runs


results = []
for overlap in (False, True):
    m = Functional()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), overlap_forward=overlap,
                                   named_parameters=[(f"func.{overlap}.{k}", p) for k, p in m.named_parameters()])
    for step in range(4):
        opt.zero_grad()
        (m(torch.ones(3, 4) * (r + step)) ** 2).sum().backward()
        opt.step()
    results.append(torch.cat([t.reshape(-1) for t in m.state_dict().values()]))
assert torch.equal(results[0], results[1]), (results[0] - results[1]).abs().max()

# a module skipped in some steps' forward (LayerDrop; on every rank, then on rank 1 only) and a validation
# under torch.inference_mode between steps: equal to the plain optimizer. The skipped module's update stayed
# pending into the next backward ("the gradient of 'out.bias' was marked ready twice", an abort), and updates
# applied under inference_mode made the optimizer's state inference tensors (the next update failed).
class Drop(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.a, self.b, self.out = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 1)

    def forward(self, x, skip):
        h = torch.tanh(self.a(x))
        if not skip:
            h = torch.tanh(self.b(h))
        return self.out(h)


def drop_run(kind, overlap):
    m = Drop()
    base = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) if kind == "sgd"
            else torch.optim.Adam(m.parameters(), lr=0.01))
    opt = hvd.DistributedOptimizer(base, overlap_forward=overlap,
                                   named_parameters=[(f"drop.{kind}.{overlap}.{k}", p) for k, p in m.named_parameters()])
    g = torch.Generator().manual_seed(6)
    for step in range(7):
        x = torch.randn(4 * n, 6, generator=g)[r * 4:(r + 1) * 4]
        opt.zero_grad()
        m(x, step in (2, 3) or (step == 5 and r == 1)).pow(2).mean().backward()
        opt.step()
        if step == 0:  # a validation pass: the deferred updates are applied in its forward
            m.eval()
            with torch.inference_mode():
                m(x, False)
            m.train()
    opt.synchronize()
    return torch.cat([t.reshape(-1) for t in m.state_dict().values()])


for kind in ("sgd", "adam"):
    plain, overlapped = drop_run(kind, False), drop_run(kind, True)
    assert torch.equal(plain, overlapped), f"LayerDrop {kind}: max diff {(plain - overlapped).abs().max()}"


# with backward_passes_per_step=2, a module skipped in the first micro-batch and run in the second: its update,
# applied at the first backward, is what the second forward reads (no error, equal to the plain optimizer)
def drop_micro(overlap):
    m = Drop()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), overlap_forward=overlap,
                                   backward_passes_per_step=2,
                                   named_parameters=[(f"micro.{overlap}.{k}", p) for k, p in m.named_parameters()])
    g = torch.Generator().manual_seed(7)
    for step in range(4):
        opt.zero_grad()
        for micro in range(2):
            x = torch.randn(3 * n, 6, generator=g)[r * 3:(r + 1) * 3]
            m(x, micro == 0 and step >= 1).pow(2).mean().backward()
        opt.step()
    opt.synchronize()
    return torch.cat([t.reshape(-1) for t in m.state_dict().values()])


plain, overlapped = drop_micro(False), drop_micro(True)
assert torch.equal(plain, overlapped), f"LayerDrop in a micro-batch: max diff {(plain - overlapped).abs().max()}"


# set_backward_passes_per_step() between steps, where step()'s updates are still pending (it raised
# "set_backward_passes_per_step() must be called between steps"): equal to the plain optimizer
def changing_passes(overlap):
    m = Drop()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), overlap_forward=overlap,
                                   named_parameters=[(f"passes.{overlap}.{k}", p) for k, p in m.named_parameters()])
    g = torch.Generator().manual_seed(8)
    for passes in (1, 2, 3, 1):
        opt.set_backward_passes_per_step(passes)
        opt.zero_grad()
        for micro in range(passes):
            m(torch.randn(3 * n, 6, generator=g)[r * 3:(r + 1) * 3], False).pow(2).mean().backward()
        opt.step()
    opt.synchronize()
    return torch.cat([t.reshape(-1) for t in m.state_dict().values()])


plain, overlapped = changing_passes(False), changing_passes(True)
assert torch.equal(plain, overlapped), f"backward_passes_per_step changed: max diff {(plain - overlapped).abs().max()}"


# the model outside the training loop, right after step(): a copy (copy.deepcopy) holds the parameters before the
# pending updates and its state_dict() works (it raised "the gradient of '0.weight' was replaced"); pickling the
# whole model is refused naming what to do (it was "cannot pickle 'weakref.ReferenceType'"); and a model whose
# optimizer is dropped still gets the pending updates (its forward and state_dict() raised AttributeError).
def twin(tag, overlap):
    m = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), overlap_forward=overlap,
                                   named_parameters=[(f"{tag}.{k}", p) for k, p in m.named_parameters()])
    return m, opt


def one_step(m, opt, step):
    g = torch.Generator().manual_seed(50 + step)
    x = torch.randn(8 * n, 1, 8, 8, generator=g)[r * 8:(r + 1) * 8]
    y = torch.randint(0, 10, (8 * n,), generator=g)[r * 8:(r + 1) * 8]
    opt.zero_grad()
    F.cross_entropy(m(x), y).backward()
    opt.step()


def params(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


m, opt = twin("twin.plain", False)
for step in range(3):
    before = params(m).clone()
    one_step(m, opt, step)
after = params(m)
m, opt = twin("twin.copy", True)
for step in range(3):
    one_step(m, opt, step)
best = copy.deepcopy(m)
assert torch.equal(params(best), before), "the copy does not hold the parameters before the pending updates"
best.state_dict()
m.state_dict()
assert torch.equal(params(m), after), "state_dict() did not apply the pending updates"
try:
    pickle.dumps(m)
except TypeError as exc:
    assert "overlap_forward=True" in str(exc) and "optimizer.remove_hooks()" in str(exc), exc
else:
    raise AssertionError("a model with overlap_forward's hooks was pickled")
opt.remove_hooks()
assert torch.equal(params(pickle.loads(pickle.dumps(m))), after)
m, opt = twin("twin.dropped", True)
for step in range(3):
    one_step(m, opt, step)
del opt
gc.collect()
with torch.no_grad():
    m(torch.zeros(1, 1, 8, 8))
assert torch.equal(params(m), after), "the updates pending when the optimizer was dropped were lost"

# model.zero_grad() after step(), before the next forward applies the deferred updates. Set to None, it is carried
# out after the update, as the optimizer's zero_grad() is (it raised "the gradient of '0.weight' was replaced ...
# zero gradients only after step()"); zeroed in place, it raced the averaging and the ranks drifted apart silently:
# an error naming the parameter (at the end of this script: its updates stay pending).
def zeroing_model(tag, overlap, set_to_none):
    m, opt = twin(tag, overlap)
    for step in range(3):
        g = torch.Generator().manual_seed(50 + step)
        x = torch.randn(8 * n, 1, 8, 8, generator=g)[r * 8:(r + 1) * 8]
        y = torch.randint(0, 10, (8 * n,), generator=g)[r * 8:(r + 1) * 8]
        F.cross_entropy(m(x), y).backward()
        opt.step()
        m.zero_grad(set_to_none=set_to_none)
    m.state_dict()  # (applies the deferred updates)
    assert all(p.grad is None for p in m.parameters()), "model.zero_grad() did not leave the gradients None"
    opt.remove_hooks()
    return params(m)


got = zeroing_model("zeroing.overlap", True, True)
assert torch.equal(got, zeroing_model("zeroing.plain", False, True)), "model.zero_grad() after step(): other results"
assert torch.equal(hvd.broadcast(got, 0, name="check.zeroing"), got)

# load_state_dict while an update is pending: it is applied first, then the load overwrites it (applied in the
# next forward instead, it moved the loaded values: TorchState.restore() missed the commit by the last step)
m, opt = twin("twin.restore", True)
state = hvd.elastic.TorchState(model=m, optimizer=opt)
one_step(m, opt, 0)
state.commit()  # (reads the state_dict: step 0's update is applied)
committed = params(m).clone()
one_step(m, opt, 1)  # its update is pending
state.restore()
with torch.no_grad():
    m(torch.zeros(1, 1, 8, 8))  # where a pending update would be applied
assert torch.equal(params(m), committed), f"restore() missed the commit by {(params(m) - committed).abs().max()}"

# a parameter read by code outside every module forward gets a clear error, not a stale value
free = nn.Linear(4, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(free.parameters(), lr=0.1),
                               named_parameters=[(f"free.{k}", p) for k, p in free.named_parameters()],
                               overlap_forward=True)
F.linear(torch.ones(3, 4), free.weight, free.bias).sum().backward()
opt.step()
try:
    F.linear(torch.ones(3, 4), free.weight, free.bias).sum().backward()
except RuntimeError as exc:
    assert "'free." in str(exc) and "was used before its deferred update was applied" in str(exc), exc
    say(f"ERROR-SEEN rank={r}: {exc}")
else:
    raise AssertionError("use of a parameter with a pending update was not detected")
try:
    zeroing_model("zeroing.in_place", True, False)
except RuntimeError as exc:
    assert "the gradient of 'zeroing.in_place.0.weight' was changed or replaced after step()" in str(exc), exc
else:
    raise AssertionError("model.zero_grad(set_to_none=False) before the deferred updates was not refused")
say(f"OK rank={r}")
sys.exit(0)
