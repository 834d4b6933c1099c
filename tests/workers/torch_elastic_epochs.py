"""An ``hvd.elastic.run`` function that trains one epoch, called once per epoch from the script's own loop over
one TorchState (validation would go between epochs, outside it), which commits after each batch and at each epoch's
end. On the first start rank 1 kills itself at epoch 2, batch 2. The restarted job resumes there: it trains the
rest of epoch 2 and epoch 3 only (each epoch's call was a phase of its own: the restart replayed epochs 1 and 2
from each one's last commit), calls the reset callbacks once, and ends with the parameters of one process trained on
the whole batch without interruption. Usage: torch_elastic_epochs.py"""

import os
import signal

import torch
import torch.nn as nn

import aiacc.torch as hvd
from report import say

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
EPOCHS, STEPS, BATCH = 4, 4, 8
g = torch.Generator().manual_seed(9)
DATA = [[(torch.randn(BATCH, 3, generator=g), torch.randn(BATCH, 1, generator=g)) for _ in range(STEPS)]
        for _ in range(EPOCHS)]
rows = slice(r * BATCH // n, (r + 1) * BATCH // n)


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


model = net()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0, batch=0)
resets = []
state.register_reset_callbacks([lambda: resets.append(1)])
trained = []


@hvd.elastic.run
def train_one_epoch(state):
    while state.batch < STEPS:
        if r == 1 and (state.epoch, state.batch) == (2, 2) and hvd.elastic.restart_count() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = DATA[state.epoch][state.batch]
        opt.zero_grad()
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        trained.append(f"{state.epoch}.{state.batch}")
        state.batch += 1
        state.commit()


while state.epoch < EPOCHS:
    train_one_epoch(state)
    state.epoch += 1
    state.batch = 0
    state.commit()

ref = net()
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
for epoch in DATA:
    for x, y in epoch:
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
for i, (p, q) in enumerate(zip(model.parameters(), ref.parameters())):
    assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), f"parameter {i} on rank {r}: max err {(p - q).abs().max()}"
say(f"TRAINED rank={r} restarts={hvd.elastic.restart_count()} resets={len(resets)} steps={','.join(trained)}")
say(f"OK rank={r} restarts={hvd.elastic.restart_count()}")
