"""overlap_forward: deferred per-layer updates give exactly the results of the plain optimizer.

Two copies of a model train side by side on the same data (each rank on its shard): one with
DistributedOptimizer(overlap_forward=False), one with overlap_forward=True, under a learning-rate
scheduler that changes the lr every step. Parameters must be equal after every step (checked
after the next forward, and through state_dict()).
"""

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
            else torch.optim.Adam(model.parameters(), lr=0.01))
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


for kind in ("sgd", "adam"):
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
say(f"OK rank={r}")
sys.exit(0)
