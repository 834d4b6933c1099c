"""Memory over a long run of DistributedTrainer steps of a static block (MXNet). With UCX's mmap hooks installed
(the ``mpich`` wheel's default) every step kept ~155 B for good; aiacc turns the hooks off before MPI loads
(aiacc.transport.mpi).

Prints ``grown=<bytes per step>`` and ``OK rank=<r>``. argv: [steps]
"""

import gc
import os
import sys

import numpy as np

import aiacc.mxnet as hvd
from mxnet import autograd, gluon, nd

hvd.init()
r = hvd.rank()
STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 3000


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(8, in_units=4), gluon.nn.Dense(1, in_units=8))
net.initialize()
net.hybridize(static_alloc=True, static_shape=True)
trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 1e-6})
x = nd.full((2, 4), r + 1.0)


def step():
    with autograd.record():
        loss = net(x).sum()
    loss.backward()
    trainer.step(2)


for _ in range(1000):  # the engine's pools, MXNet's: what a run holds from its start
    step()
nd.waitall()
gc.collect()
before = rss()
for _ in range(STEPS):
    step()
nd.waitall()
gc.collect()
grown = (rss() - before) / STEPS
bias = net[1].bias.data().asnumpy()
rows = hvd.allgather(nd.array(bias.reshape(1, -1)), name="memory.check").asnumpy()
assert np.array_equal(rows[0], rows[1]), rows  # the ranks trained alike
print(f"grown={grown:.1f} rank={r}", flush=True)
print(f"OK rank={r}", flush=True)
