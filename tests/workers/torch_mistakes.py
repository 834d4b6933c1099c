"""Mistakes of a script migrated from Horovod or DDP that used to hang: broadcast_parameters of models that differ
across ranks (a layer more on one rank, as a state_dict or named_parameters; plain tensors, one more on one
rank). Each rank waited for broadcasts the others never sent, a hang until the stall shutdown (30 minutes); now
one TensorMismatchError on every rank naming the tensors and the ranks that have them, nothing changed, and the
job goes on. Then a rank that runs one step fewer (uneven shards, no join()): the other's error names it and says
what to do (join())."""

import torch

import aiacc
import aiacc.torch as hvd
from report import raises, say

hvd.init()
r = hvd.rank()


def model(extra: bool) -> torch.nn.Sequential:
    torch.manual_seed(r)  # each rank starts from its own weights
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2), *([torch.nn.Linear(2, 2)] if extra else []))


m = model(extra=(r == 1))
before = {k: v.clone() for k, v in m.state_dict().items()}
for case, params, words in (
    ("state_dict", lambda: m.state_dict(), ["rank 0: 4; rank 1: 6 tensors",
                                            "only rank 1 has 'Parameter.2.bias', 'Parameter.2.weight'"]),
    ("named_parameters", lambda: m.named_parameters(), ["only rank 1 has 'Parameter.2.bias', 'Parameter.2.weight'"]),
    ("parameters", lambda: m.parameters(), ["rank 0: 4; rank 1: 6 tensors", "only rank 1 has '#4', '#5'"]),
):
    say(f"ERROR-SEEN rank={r} {case}: "
        + raises(hvd.TensorMismatchError, lambda: hvd.broadcast_parameters(params(), root_rank=0),
                 "broadcast_parameters: the ranks have different tensors", *words))
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items()), f"{case}: a refused broadcast changed"

# the model itself instead of its state_dict (a Sequential is iterable: its layers): refused, saying what to pass
say(f"ERROR-SEEN rank={r} module: " + raises(ValueError, lambda: hvd.broadcast_parameters(m, root_rank=0),
                                             "not the Sequential module itself", "model.state_dict()"))

# the job goes on: the same model on every rank is broadcast (by name, and plain tensors by position)
same = model(extra=False)
hvd.broadcast_parameters(same.state_dict(), root_rank=0)
w = same[0].weight.detach().clone()
torch.manual_seed(0)
assert torch.equal(w, torch.nn.Linear(4, 3).weight.detach()), "rank 0's weights did not arrive"
same = model(extra=False)
hvd.broadcast_parameters(same.parameters(), root_rank=0)
assert torch.equal(same[0].weight.detach(), w), "rank 0's weights did not arrive by position"

# uneven shards without join(): rank 1 leaves the loop (and the script) a step early
opt = hvd.DistributedOptimizer(torch.optim.SGD(same.parameters(), lr=0.1), named_parameters=same.named_parameters())


def train(steps):
    for _ in range(steps):
        opt.zero_grad()
        same(torch.ones(3, 4)).sum().backward()
        opt.step()


if r == 0:
    say("ERROR-SEEN rank=0 uneven: " + raises(aiacc.ShutdownError, lambda: train(3), "shut down by rank 1",
                                                 "if it ran out of data before this rank",
                                                 "end each rank's training loop with join()"))
else:
    train(2)
say(f"OK rank={r}")
