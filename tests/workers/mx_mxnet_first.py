"""A Horovod-style MXNet script that imports mxnet before aiacc.mxnet (as Horovod's examples do). MXNet 1.9.1
refers to numpy.bool, which numpy 1.26 removed: run as ``python SCRIPT`` it fails at its first line; run as
``python -m aiacc.mxnet SCRIPT ARGS`` it runs unchanged, as ``__main__``, with its own argv and directory.
One DistributedTrainer step equals the average of the ranks' gradients."""

import sys

import mxnet as mx  # noqa: I001 - first, on purpose
from mxnet import autograd, gluon

import aiacc.mxnet as hvd
from report import say  # (the script's directory is on sys.path, as for python SCRIPT)

assert __name__ == "__main__"
assert sys.argv[1:] == ["--lr", "0.5"], sys.argv
lr = float(sys.argv[2])
hvd.init()
r, n = hvd.rank(), hvd.size()
net = gluon.nn.Dense(1, use_bias=False, in_units=2)
net.initialize(mx.init.One(), ctx=mx.cpu())
trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": lr})
x = mx.nd.full((1, 2), r + 1.0)
with autograd.record():
    loss = net(x).sum()
loss.backward()
trainer.step(1)
mean = sum(k + 1.0 for k in range(n)) / n  # d loss / d w = x = rank + 1, averaged
got = net.weight.data().asnumpy()
assert abs(got - (1.0 - lr * mean)).max() < 1e-6, got
say(f"OK rank={r}")
hvd.shutdown()
