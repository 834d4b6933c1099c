"""TorchState with a further optimizer given as a keyword (Horovod's way to keep several): commit() copies the
optimizers' state in the background, and a step of that optimizer must wait for the copy as the main one's does.
The copy is held back (its thread waits up to 2 s for the step to have run), so a step that does not wait lands
in the commit every time: restore() then gave back the momentum after that step. Parameters changed in place
outside any optimizer after commit() (Horovod deep-copies at commit) come back as they were at commit() on every
rank (before, the background copy could see the change: restore() gave it back, on some ranks only), and so does
a tensor learning rate a scheduler changes in place after commit()."""

import threading

import torch
import torch.nn as nn

import aiacc.torch as hvd
from aiacc.torch import elastic as torch_elastic
from report import hold_back_commit_copies, say

hvd.init()
torch.set_num_threads(1)
r = hvd.rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
opt_a = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
opt_b = torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)
state = hvd.elastic.TorchState(model=model, optimizer=opt_a, opt_b=opt_b, epoch=0)

stepped = threading.Event()
hold_back_commit_copies(torch_elastic, stepped)
x = torch.randn(8, 4)
checks = 0
for k in range(3):
    for opt in (opt_a, opt_b):
        opt.zero_grad()
    model(x).square().mean().backward()
    opt_a.step()
    opt_b.step()
    state.commit()
    at_commit = {name: p.detach().clone() for name, p in model.named_parameters()}
    momenta = [opt.state[p]["momentum_buffer"].clone() for opt in (opt_a, opt_b) for g in opt.param_groups
               for p in g["params"]]
    for opt in (opt_a, opt_b):
        opt.zero_grad()
    model(x).square().mean().backward()
    opt_b.step()  # waits for the copy (else it runs now, and the copy sees its update)
    stepped.set()
    opt_a.step()
    stepped.clear()
    state.restore()
    moved = {name: float((p.detach() - at_commit[name]).abs().max()) for name, p in model.named_parameters()}
    assert max(moved.values()) == 0.0, f"rank {r}: restore() is not the state at commit(): {moved}"
    restored = [opt.state[p]["momentum_buffer"] for opt in (opt_a, opt_b) for g in opt.param_groups for p in g["params"]]
    assert all(torch.equal(a, b) for a, b in zip(momenta, restored)), f"rank {r}: momentum after restore() differs"
    checks += 1

# parameters changed in place outside the optimizers between commit() and restore()
state.commit()
at_commit = {name: p.detach().clone() for name, p in model.named_parameters()}
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
stepped.set()  # (the background copy may run now)
state.restore()
moved = {name: float((p.detach() - at_commit[name]).abs().max()) for name, p in model.named_parameters()}
assert max(moved.values()) == 0.0, f"rank {r}: restore() gave back a change made after commit(): {moved}"
checks += 1
# a scheduler changing a tensor learning rate in place (fill_) after commit(): restore() gives back the committed one
lin = nn.Linear(4, 2)
adam = torch.optim.Adam(lin.parameters(), lr=torch.tensor(0.01))
sched = torch.optim.lr_scheduler.StepLR(adam, step_size=1, gamma=0.5)
lr_state = hvd.elastic.TorchState(model=lin, optimizer=adam)
lin(x).sum().backward()
adam.step()
lr_state.commit()
sched.step()
lr_state.restore()
assert float(adam.param_groups[0]["lr"]) == float(torch.tensor(0.01)), f"rank {r}: lr after restore() {adam.param_groups[0]['lr']}"
checks += 1
say(f"OK rank={r} checks={checks}")
