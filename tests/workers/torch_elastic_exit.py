"""A script whose last line commits a TorchState: the process must end normally.

commit() leaves the copy of the optimizer's state to a background thread; if the interpreter shuts down
while that thread is inside torch's copy, CPython ends the thread in the middle of C++ code and the process
aborts (``terminate called without an active exception``, SIGABRT) instead of exiting with status 0.
The optimizer's state here is large (Adam's moments of ~100 MB) so that the copy is still running at exit.
"""

import torch

import aiacc.torch as hvd
from aiacc.torch.elastic import TorchState

hvd.init()

torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(3)])
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
model(torch.randn(4, 2048)).square().mean().backward()
opt.step()
state = TorchState(model=model, optimizer=opt, epoch=0)
for epoch in range(1, 3):
    state.epoch = epoch
    state.commit()
print(f"OK rank={hvd.rank()}", flush=True)  # the last line: the commit's copy is still running
