"""Blocks hybridized with static_alloc=True, static_shape=True under DistributedTrainer train exactly as the same
blocks hybridized plainly: their CachedOp binds the gradient arrays in its first backward and kept writing those
after the gradients moved into the buckets (p.grad() read 0 before step(), clipping and zero_grad() missed what
backward wrote, grad_req='add' summed without end, a static child unused in the second step read a stale
bucket ever after). Each rank checks, every step, p.grad() right after backward against the plain twin's, and
the parameters after step()."""

import numpy as np

import aiacc.mxnet as hvd
import mxnet as mx
from mxnet import autograd, gluon, nd

from report import say

hvd.init()
r, n = hvd.rank(), hvd.size()
checks = 0


class Net(gluon.Block):
    """A plain parent with two hybridized children; ``b`` runs only on even steps."""

    def __init__(self, prefix, static):
        super().__init__(prefix=prefix)
        with self.name_scope():
            self.a = gluon.nn.HybridSequential()
            self.a.add(gluon.nn.Dense(8, activation="tanh", in_units=5), gluon.nn.Dense(3, in_units=8))
            self.b = gluon.nn.Dense(3, in_units=5)
        for child in (self.a, self.b):
            child.hybridize(static_alloc=static, static_shape=static)

    def forward(self, x, use_b):
        y = self.a(x)
        return y + self.b(x) if use_b else y


def make(prefix, static, req):
    mx.random.seed(1)
    net = Net(prefix, static)
    net.initialize(mx.init.Xavier())
    for p in net.collect_params().values():
        p.grad_req = req
    return net


rng = np.random.default_rng(3 + r)
for req, passes in (("write", 1), ("add", 2)):
    nets = [make(f"{req}_s_", True, req), make(f"{req}_p_", False, req)]
    trainers = [hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                                       prefix=f"{req}{k}.") for k, net in enumerate(nets)]
    for step in range(6):
        x = nd.array(rng.standard_normal((4, 5)).astype(np.float32))
        for net in nets:
            for _ in range(passes):
                with autograd.record():
                    loss = (net(x, step % 2 == 0) ** 2).sum()
                loss.backward()
        grads = [[p.grad().asnumpy() for p in net.collect_params().values()] for net in nets]
        for g_static, g_plain in zip(*grads):
            assert np.allclose(g_static, g_plain, atol=1e-6), (req, step, g_static, g_plain)
        if step == 3:  # an edit of the gradients before step() (clipping) counts
            for net in nets:
                gluon.utils.clip_global_norm([p.grad() for p in net.collect_params().values()], 0.5)
        for trainer in trainers:
            trainer.step(4, ignore_stale_grad=True)
        for net in nets:
            net.collect_params().zero_grad()
        for p, q in zip(*(net.collect_params().values() for net in nets)):
            assert np.allclose(p.data().asnumpy(), q.data().asnumpy(), atol=1e-6), (req, step, p.name)
        checks += 1
say(f"OK rank={r} checks={checks}")
