"""An MXNet job whose ranks start from different parameters (seeded by rank) unless argv[1] is 1 (then
``broadcast_parameters``, deferred to the first forward): ``DistributedTrainer``'s check at its second update. The
net has BatchNorm, whose running statistics (grad_req 'null') differ across ranks legitimately. argv[2] ``optimizer``:
Horovod's other MXNet recipe instead, ``gluon.Trainer(..., hvd.DistributedOptimizer(opt), kvstore=None)`` (the
optimizer's check at the second step's first update, as for the Module API). Prints the check's warnings
(``WARNED``), the collectives of each step after the first (``COUNTS``), then ``OK rank=<r>``."""

import sys
import warnings

import aiacc.mxnet as hvd
from report import report_same_start
import mxnet as mx
from mxnet import autograd, gluon

broadcast, optimizer = sys.argv[1] == "1", sys.argv[2:] == ["optimizer"]
hvd.init()
rank = hvd.rank()
mx.random.seed(rank)
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(5, activation="relu"), gluon.nn.BatchNorm(), gluon.nn.Dense(2))
net.initialize(mx.init.Xavier())
if broadcast:
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
if optimizer:
    trainer = gluon.Trainer(net.collect_params(), hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.1,
                                                                                            momentum=0.9)), kvstore=None)
else:
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9})


def collectives() -> int:
    s = hvd.summary()
    return sum(s[k] for k in ("allreduce_requests", "allgather", "broadcast", "alltoall", "reducescatter", "barrier"))


counts = []
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    for step in range(6):
        x = mx.nd.random.normal(shape=(8, 4))
        with autograd.record():
            loss = net(x).square().sum()
        loss.backward()
        trainer.step(8)
        mx.nd.waitall()
        counts.append(collectives())
report_same_start(rank, seen, counts)
