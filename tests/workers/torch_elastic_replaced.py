"""An optimizer put on a TorchState after it was made (``state.optimizer = new``, as a reset callback that builds
the optimizer again for the new number of ranks does; or a further optimizer keyword replaced): commit() copies
its state in the background, and its step() must wait for that copy as the first optimizer's does. The copy is
held back (its thread waits up to 2 s for the step to have run), so a step that does not wait lands in the
commit every time: before, restore() gave back the momentum after that step (only the optimizers held at the
first commit waited)."""

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


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


state = hvd.elastic.TorchState(model=model, optimizer=sgd(model[0].parameters()), opt_b=sgd(model[2].parameters()))
stepped = threading.Event()
hold_back_commit_copies(torch_elastic, stepped)
x = torch.randn(8, 4)


def train(opts):
    for opt in opts:
        opt.zero_grad()
    model(x).square().mean().backward()
    for opt in opts:
        opt.step()


train([state.optimizer, state.opt_b])
state.commit()  # the optimizers held now are hooked
checks = 0
for k, replace in enumerate(("optimizer", "opt_b", "both")):
    if replace in ("optimizer", "both"):
        state.optimizer = sgd(model[0].parameters())
    if replace in ("opt_b", "both"):
        state.opt_b = sgd(model[2].parameters())
    opts = [state.optimizer, state.opt_b]
    train(opts)
    state.commit()
    at_commit = {name: p.detach().clone() for name, p in model.named_parameters()}
    momenta = [opt.state[p]["momentum_buffer"].clone() for opt in opts for g in opt.param_groups for p in g["params"]]
    train(opts)  # each step waits for the copy (else it runs now, and the copy sees its update)
    stepped.set()
    state.restore()
    stepped.clear()
    moved = {name: float((p.detach() - at_commit[name]).abs().max()) for name, p in model.named_parameters()}
    assert max(moved.values()) == 0.0, f"rank {r}, {replace} replaced: restore() is not the state at commit(): {moved}"
    restored = [opt.state[p]["momentum_buffer"] for opt in opts for g in opt.param_groups for p in g["params"]]
    diff = max(float((a - b).abs().max()) for a, b in zip(momenta, restored))
    assert diff == 0.0, f"rank {r}, {replace} replaced: the momentum after restore() is not the committed one ({diff})"
    checks += 1
say(f"OK rank={r} checks={checks}")
