"""A learning-rate scheduler and a GradScaler given to TorchState as keywords (objects with ``state_dict`` and
``load_state_dict``, torch's Stateful protocol) are kept as their state dicts, as further models and
optimizers are: ``restore()`` and ``sync()`` load the committed / rank 0's position into the same objects, so
the scheduler goes on driving the optimizer that trains. Before, they were pickled whole like ``epoch``: after
``restore()``, ``sync()`` on the other ranks or a restart, ``state.scheduler`` was a copy bound to a copy of
the optimizer, and stepping it no longer changed the learning rate of the training.
Then restart-based recovery: rank 1 raises at step FAIL_STEP on the first start; the restarted job resumes the
schedule where the commit left it and ends with the parameters of one process trained without interruption.
Usage: torch_elastic_stateful.py FAIL_STEP"""

import os
import sys
import warnings

import torch
import torch.nn as nn

import aiacc.torch as hvd
from report import say

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
FAIL_STEP = int(sys.argv[1])
STEPS, BATCH = 10, 12
checks = 0  # (counted anew by the restarted start)


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def lr(opt):
    return float(opt.param_groups[0]["lr"])


if hvd.elastic.restart_count() == 0:
    # commit, restore and sync in one start (kept in memory only: this state's commits are not the job's)
    elastic_dir = os.environ.pop("AIACC_ELASTIC_DIR")
    warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step()` before")  # (no training here)
    m = net()
    o = torch.optim.SGD(m.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(1))  # (its scale tensor exists from the first scale())
    st = hvd.elastic.TorchState(model=m, optimizer=o, scheduler=sched, scaler=scaler, epoch=0)
    st.scheduler.step()
    st.commit()  # lr 0.5, last_epoch 1, scale 8
    st.scheduler.step()
    st.scaler.update(64.0)
    st.restore()
    assert st.scheduler is sched and st.scaler is scaler, f"rank {r}: restore() replaced the objects"
    assert (sched.last_epoch, lr(o), scaler.get_scale()) == (1, 0.5, 8.0), \
        f"rank {r}: after restore(): {sched.last_epoch}, {lr(o)}, {scaler.get_scale()}"
    st.scheduler.step()
    assert lr(o) == 0.25, f"rank {r}: the restored scheduler does not drive the optimizer: lr {lr(o)}"
    checks += 1
    for _ in range(r):  # the ranks' schedulers differ; sync() gives every rank rank 0's position
        sched.step()
    scaler.update(16.0 * (r + 1))
    st.sync()
    assert st.scheduler is sched and (sched.last_epoch, lr(o), scaler.get_scale()) == (2, 0.25, 16.0), \
        f"rank {r}: after sync(): {sched.last_epoch}, {lr(o)}, {scaler.get_scale()}"
    st.scheduler.step()
    assert lr(o) == 0.125, f"rank {r}: the synced scheduler does not drive the optimizer: lr {lr(o)}"
    checks += 1
    os.environ["AIACC_ELASTIC_DIR"] = elastic_dir
    say(f"SAME OBJECTS rank={r} checks={checks}")

g = torch.Generator().manual_seed(3)
DATA = [(torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)) for _ in range(STEPS)]
model = net()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.4, momentum=0.9),
                               named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0,
                               scheduler=torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5))
rows = slice(r * BATCH // n, (r + 1) * BATCH // n)


@hvd.elastic.run
def train(state):
    say(f"RESUME rank={r} step={state.step} lr={lr(opt)}")
    while state.step < STEPS:
        if r == 1 and state.step == FAIL_STEP and hvd.elastic.restart_count() == 0:
            raise RuntimeError(f"planned failure at step {state.step}")
        x, y = DATA[state.step]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()
        state.scheduler.step()
        state.step += 1
        state.commit()


train(state)
ref = net()
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.4, momentum=0.9)
ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=3, gamma=0.5)
for x, y in DATA:
    ref_opt.zero_grad()
    nn.functional.cross_entropy(ref(x), y).backward()
    ref_opt.step()
    ref_sched.step()
assert lr(opt) == lr(ref_opt), f"rank {r}: lr {lr(opt)} at the end, {lr(ref_opt)} without interruption"
for i, (p, q) in enumerate(zip(model.parameters(), ref.parameters())):
    assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), f"parameter {i} on rank {r}: max err {(p - q).abs().max()}"
checks += 1
say(f"OK rank={r} restarts={hvd.elastic.restart_count()} checks={checks}")
