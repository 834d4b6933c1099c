"""Two elastic phases in one script, as in pretraining then fine-tuning: each ``hvd.elastic.run`` with a
TorchState of its own; the second keeps a further model and its DistributedOptimizer as keywords (Horovod's way
to hold several). On the first start rank KILL_RANK kills itself at step KILL_STEP of phase KILL_PHASE (or never).
Under ``aiaccrun --max-restarts 1 --elastic-dir DIR`` the restarted job replays the phases in order, each from
its own last commit, and ends with the parameters of one process trained on the whole batch without
interruption. Usage: torch_elastic_phases.py KILL_RANK KILL_PHASE KILL_STEP {kill|never}"""

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
KILL_RANK, KILL_PHASE, KILL_STEP, HOW = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
BATCH, STEPS = 8, (4, 6)
g = torch.Generator().manual_seed(5)
DATA = [(torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 2, generator=g)) for _ in range(sum(STEPS))]
rows = slice(r * BATCH // n, (r + 1) * BATCH // n)


def net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def step_of(phase, state, pairs, whole=False):
    x, y = DATA[sum(STEPS[:phase]) + state.step]
    for model, opt in pairs:
        opt.zero_grad()
        nn.functional.mse_loss(model(x if whole else x[rows]), y if whole else y[rows]).backward()
        opt.step()


def phase_run(phase, state, pairs):
    @hvd.elastic.run
    def train(state):
        say(f"RESUME rank={r} phase={phase} step={state.step}")
        while state.step < STEPS[phase]:
            if (HOW == "kill" and r == KILL_RANK and phase == KILL_PHASE and state.step == KILL_STEP
                    and hvd.elastic.restart_count() == 0):
                os.kill(os.getpid(), signal.SIGKILL)
            step_of(phase, state, pairs)
            state.step += 1
            state.commit()
    train(state)


model = net(0)
opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(prefix="model"))
phase_run(0, hvd.elastic.TorchState(model=model, optimizer=opt, step=0), [(model, opt)])
disc = net(1)
disc_opt = hvd.DistributedOptimizer(sgd(disc), named_parameters=disc.named_parameters(prefix="disc"))
state = hvd.elastic.TorchState(model=model, optimizer=opt, disc=disc, disc_opt=disc_opt, step=0)
phase_run(1, state, [(model, opt), (disc, disc_opt)])
assert state.disc is disc and state.disc_opt is disc_opt, "the state's models are not the script's"

ref, ref_disc = net(0), net(1)
ref_opt, ref_disc_opt = sgd(ref), sgd(ref_disc)


class _Step:
    step = 0


for phase, pairs in ((0, [(ref, ref_opt)]), (1, [(ref, ref_opt), (ref_disc, ref_disc_opt)])):
    for k in range(STEPS[phase]):
        _Step.step = k
        step_of(phase, _Step, pairs, whole=True)
for what, got, want in (("model", model, ref), ("disc", disc, ref_disc)):
    for i, (p, q) in enumerate(zip(got.parameters(), want.parameters())):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), f"{what} parameter {i} on rank {r}: max err {(p - q).abs().max()}"
say(f"OK rank={r} restarts={hvd.elastic.restart_count()}")
