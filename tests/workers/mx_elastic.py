"""Restart-based recovery with aiacc.mxnet's hvd.elastic.MXNetState: Gluon training with DistributedTrainer
(SGD with momentum) committed every step; on the first start rank KILL_RANK kills itself with SIGKILL at step
KILL_STEP. Restarted by ``aiaccrun --max-restarts``, the job resumes from the last commit and ends with the
parameters of one process trained on the whole batch with a plain gluon.Trainer (1e-5 relative).
Usage: mx_elastic.py KILL_RANK KILL_STEP"""

import sys

import numpy as np

import aiacc.mxnet as hvd
import mxnet as mx
from mxnet import autograd, gluon

from report import kill_on_first_start, say

hvd.init()
r, n = hvd.rank(), hvd.size()
KILL_RANK, KILL_STEP = int(sys.argv[1]), int(sys.argv[2])
STEPS, BATCH = 10, 8
rng = np.random.default_rng(0)
X = rng.normal(size=(STEPS, BATCH, 5)).astype(np.float32)
Y = rng.normal(size=(STEPS, BATCH, 3)).astype(np.float32)
loss_fn = gluon.loss.L2Loss()


def build():
    mx.random.seed(0)
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(8, activation="tanh", in_units=5), gluon.nn.Dense(3, in_units=8))
    net.initialize(mx.init.Xavier())
    return net


# a net whose shapes come with the first forward: the state names the parameter (MXNet's
# DeferredInitializationError did not say what to do)
lazy = gluon.nn.Dense(3)
lazy.initialize()
try:
    hvd.elastic.MXNetState(params=lazy.collect_params(), step=0)
except hvd.elastic.ElasticStateError as exc:
    assert "is not initialised yet (deferred initialisation" in str(exc) and "weight" in str(exc), exc
else:
    raise AssertionError("a state over parameters not initialised yet was made")

net = build()
params = net.collect_params()
trainer = hvd.DistributedTrainer(params, "sgd", {"learning_rate": 0.1, "momentum": 0.9})
state = hvd.elastic.MXNetState(params=params, trainer=trainer, step=0)
rows = slice(r * BATCH // n, (r + 1) * BATCH // n)


@hvd.elastic.run
def train(state):
    say(f"RESUME rank={r} step={state.step}")
    while state.step < STEPS:
        kill_on_first_start(r == KILL_RANK and state.step == KILL_STEP)
        x, y = mx.nd.array(X[state.step][rows]), mx.nd.array(Y[state.step][rows])
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(BATCH // n)
        state.step += 1
        state.commit()


train(state)
ref = build()
ref_trainer = gluon.Trainer(ref.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9})
for step in range(STEPS):
    x, y = mx.nd.array(X[step]), mx.nd.array(Y[step])
    with autograd.record():
        loss = loss_fn(ref(x), y)
    loss.backward()
    ref_trainer.step(BATCH)
for (k, p), q in zip(sorted(params.items()), [v for _, v in sorted(ref.collect_params().items())]):
    assert np.allclose(p.data().asnumpy(), q.data().asnumpy(), rtol=1e-5, atol=1e-6), f"{k} on rank {r}"
say(f"OK rank={r} restarts={hvd.elastic.restart_count()}")
