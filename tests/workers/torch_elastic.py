"""Restart-based recovery with hvd.elastic: deterministic training whose state is committed every step;
on the first start, rank KILL_RANK kills itself with SIGKILL (or raises) at step KILL_STEP. Under
``aiaccrun --max-restarts N --elastic-dir DIR`` the job starts again, resumes from the last commit and ends
with the parameters of one process trained on the whole batch without interruption (1e-5 relative).
Usage: torch_elastic.py KILL_RANK KILL_STEP {kill|raise|interrupt|never} [FAIL_EVERY_START]"""

import os
import signal
import sys

import torch
import torch.nn as nn

import aiacc.torch as hvd
from report import say

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
KILL_RANK, KILL_STEP, HOW = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
EVERY_START = len(sys.argv) > 4
STEPS, BATCH = 12, 12


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


g = torch.Generator().manual_seed(3)
DATA = [(torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)) for _ in range(STEPS)]

model = net()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
rows = slice(r * BATCH // n, (r + 1) * BATCH // n)
say(f"START rank={r} restart={hvd.elastic.restart_count()}")
# Horovod's pattern (its elastic examples rescale the learning rate to the new size() here): called on a restart,
# after rank 0 loaded the commit and before the sync
state.register_reset_callbacks([lambda: say(f"RESET rank={r} size={hvd.size()} step={state.step}")])


@hvd.elastic.run
def train(state):
    say(f"RESUME rank={r} step={state.step}")
    while state.step < STEPS:
        if (r == KILL_RANK and state.step == KILL_STEP and HOW != "never"
                and (hvd.elastic.restart_count() == 0 or EVERY_START)):
            if HOW == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if HOW == "interrupt":  # Horovod's, from its commit() (aiacc's ranks stay: a script may raise it)
                raise hvd.elastic.HostsUpdatedInterrupt(False)
            raise RuntimeError(f"injected failure at step {state.step}")
        x, y = DATA[state.step]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()
        state.step += 1
        state.commit()


train(state)

ref = net()
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
for x, y in DATA:
    ref_opt.zero_grad()
    nn.functional.cross_entropy(ref(x), y).backward()
    ref_opt.step()
for i, (p, q) in enumerate(zip(model.parameters(), ref.parameters())):
    assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), f"parameter {i} on rank {r}: max err {(p - q).abs().max()}"
say(f"OK rank={r} restarts={hvd.elastic.restart_count()}")
