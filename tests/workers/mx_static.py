"""Blocks hybridized with static_alloc=True, static_shape=True under DistributedTrainer train exactly as the same
blocks hybridized plainly: their CachedOp binds the gradient arrays in its first backward and kept writing those
after the gradients moved into the buckets (p.grad() read 0 before step(), clipping and zero_grad() missed what
backward wrote, grad_req='add' summed without end, a static child unused in the second step read a stale
bucket ever after). Each rank checks, every step, p.grad() right after backward against the plain twin's, and
the parameters after step(); and no warning from the scan for static blocks with torch imported."""

import warnings

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

# Parameters initialized again (force_reinit: new gradient arrays) under a static block that still writes the
# old ones, its buckets, in the step after: the copy of the new arrays into the buckets raced those writes
# (each rank its own result, now and then). Now after them: every rank alike, and in that step as plain MXNet
# (which reads the new arrays, which its static block did not write).
def dense(prefix):
    mx.random.seed(1)
    net = gluon.nn.HybridSequential(prefix=prefix)
    with net.name_scope():
        net.add(gluon.nn.Dense(2, in_units=3))
    net.initialize(mx.init.Xavier())
    net.hybridize(static_alloc=True, static_shape=True)
    return net


ours, twin = dense("reinit_ours_"), dense("reinit_twin_")
trainers = [hvd.DistributedTrainer(ours.collect_params(), "sgd", {"learning_rate": 0.1}, prefix="reinit."),
            gluon.Trainer(twin.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=None)]
x = nd.array(np.arange(6, dtype=np.float32).reshape(2, 3) / 6)  # the same on every rank: averaging changes nothing
for step in range(5):
    if step == 2:
        for net in (ours, twin):
            mx.random.seed(11)
            net.initialize(mx.init.Uniform(0.3), force_reinit=True)
    for net, trainer in zip((ours, twin), trainers):
        with autograd.record():
            loss = (net(x) ** 2).sum()
        loss.backward()
        trainer.step(2)
    w = ours[0].weight.data()
    rows = hvd.allgather(w.reshape((1, -1)), name=f"reinit.check{step}").asnumpy()
    assert all(np.array_equal(rows[0], row) for row in rows[1:]), (step, rows)
    if step <= 2:
        assert np.allclose(w.asnumpy(), twin[0].weight.data().asnumpy(), atol=1e-6), (step, w, twin[0].weight.data())
    checks += 1

# the first step of a trainer scans the live objects for static blocks: with torch imported too, no warning of
# torch's (isinstance read torch.distributed.reduce_op's __class__, which warns 'reduce_op is deprecated')
import torch  # noqa: E402,F401 - its objects among the live ones

net = dense("warn_")
trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, prefix="warn.")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with autograd.record():
        loss = (net(x) ** 2).sum()
    loss.backward()
    trainer.step(2)
assert not caught, [f"{w.filename}:{w.lineno}: {w.message}" for w in caught]
checks += 1
say(f"OK rank={r} checks={checks}")
