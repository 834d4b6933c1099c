"""aiacc.mxnet with AIACC_ENABLE unset: the wrappers are MXNet's own, bit for bit (one plain process)."""

import numpy as np

import aiacc.mxnet as hvd
import mxnet as mx
from mxnet import autograd, gluon, nd

from report import raises, say

hvd.init()
assert not hvd.is_enabled() and hvd.size() == 1 and hvd.rank() == 0 and hvd.local_size() == 1

rng = np.random.default_rng(0)
X = rng.standard_normal((10, 8, 6)).astype(np.float32)
Y = rng.integers(0, 3, size=(10, 8)).astype(np.float32)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()


def mlp(prefix):
    net = gluon.nn.Sequential(prefix=prefix)
    with net.name_scope():
        net.add(gluon.nn.Dense(12, activation="relu", in_units=6), gluon.nn.Dense(3, in_units=12))
    return net


for opt, opt_params in [("sgd", {"learning_rate": 0.1, "momentum": 0.9}), ("adam", {"learning_rate": 0.01})]:
    mx.random.seed(5)
    ours = mlp(f"ours_{opt}_")
    ours.initialize(mx.init.Xavier())
    mx.random.seed(5)
    theirs = mlp(f"theirs_{opt}_")
    theirs.initialize(mx.init.Xavier())
    hvd.broadcast_parameters(ours.collect_params(), root_rank=0)  # a no-op on one rank
    trainer = hvd.DistributedTrainer(ours.collect_params(), opt, dict(opt_params),
                                     gradient_predivide_factor=4.0, compression=hvd.Compression.fp16)
    plain = gluon.Trainer(theirs.collect_params(), opt, dict(opt_params))  # MXNet's default kvstore
    for step in range(len(X)):
        for net, tr in ((ours, trainer), (theirs, plain)):
            with autograd.record():
                loss = loss_fn(net(nd.array(X[step])), nd.array(Y[step]))
            loss.backward()
            tr.step(X.shape[1])
    for p, q in zip(ours.collect_params().values(), theirs.collect_params().values()):
        assert np.array_equal(p.data().asnumpy(), q.data().asnumpy()), f"{opt}: {p.name} differs from gluon.Trainer"
    say(f"TRAINER_SAME opt={opt}")

sgd = mx.optimizer.SGD(learning_rate=0.1)
assert hvd.DistributedOptimizer(sgd) is sgd, "DistributedOptimizer must hand back the optimizer when disabled"

x = nd.array(np.arange(6, dtype=np.float32))
y = hvd.allreduce(x, name="x")
assert y is not x and np.array_equal(y.asnumpy(), x.asnumpy())
y[:] = 0  # a copy, as on a real job of one rank
assert x.asnumpy()[1] == 1
assert hvd.allreduce_(x, name="x_") is x and np.array_equal(hvd.allgather(x).asnumpy(), x.asnumpy())
# process sets of the job of one rank: the global set is the only one (a set of rank 0 repeats it), as under
# aiaccrun -np 1 and in Horovod
g = hvd.global_process_set
assert g.size() == 1 and g.rank() == 0
assert np.array_equal(hvd.grouped_allgather([x], process_set=g)[0].asnumpy(), x.asnumpy())
assert np.array_equal(hvd.reducescatter(x, op=hvd.Sum, process_set=g).asnumpy(), x.asnumpy())
assert hvd.DistributedOptimizer(sgd, process_set=g) is sgd
raises(ValueError, lambda: hvd.add_process_set([0]), "Attempted to add a duplicate process set")
raises(ValueError, lambda: hvd.DistributedOptimizer(sgd, process_set=hvd.ProcessSet([0])),
       "is not a registered process set")
assert not hvd.remove_process_set(g)
# Horovod's num_groups: a count (which changes nothing), checked in every mode
raises(ValueError, lambda: hvd.DistributedOptimizer(sgd, num_groups=-2), "DistributedOptimizer: num_groups=-2")
raises(ValueError, lambda: hvd.DistributedTrainer(ours.collect_params(), "sgd", num_groups="x"),
       "DistributedTrainer: num_groups='x'")
assert hvd.DistributedOptimizer(sgd, num_groups=2) is sgd
say("OK rank=0")
