"""A script whose last line commits a TorchState to the elastic directory, then a second start of it.

``commit`` (every start): train inside ``hvd.elastic.run`` (one commit, epoch 0), then, after it returned, one more
step and a commit of epoch 99 as the script's last line, as a user saves the end of training. Prints
``COMMITTED rank=R epoch=99 sum=<the model's parameters, summed in float64>``.

``check``: a second start of the same job (same elastic directory): ``hvd.elastic.run`` loads the newest commit,
and the function prints what it resumed from: ``RESUMED rank=R epoch=E sum=S``, and the commit files and
partial (``.tmp``) files the first start left.

The state is large (~150 MB: three 2048x2048 layers and Adam's moments) so that rank 0's commit writer is still
writing when the interpreter reaches its exit.
"""

import os
import sys

import torch

import aiacc.torch as hvd

hvd.init()
mode = sys.argv[1]
directory = os.environ["AIACC_ELASTIC_DIR"]

torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(3)])
opt = torch.optim.Adam(model.parameters(), lr=1e-3)


def step():
    opt.zero_grad()
    model(torch.randn(4, 2048)).square().mean().backward()
    opt.step()


def total():
    with torch.no_grad():
        return repr(sum(float(p.double().sum()) for p in model.parameters()))


state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0)


@hvd.elastic.run
def train(state):
    if mode == "check":
        names = sorted(os.listdir(directory)) if hvd.rank() == 0 else []
        print(f"RESUMED rank={hvd.rank()} epoch={state.epoch} sum={total()} files={','.join(names)}", flush=True)
        return
    for state.epoch in range(state.epoch, 1):
        step()
        state.commit()


train(state)
if mode == "commit":
    step()
    state.epoch = 99
    print(f"COMMITTED rank={hvd.rank()} epoch=99 sum={total()}", flush=True)
    state.commit()  # the script's last line: the commit is written after this returns
