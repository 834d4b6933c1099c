"""DistributedTrainer with parameters that only some ranks' data uses in a step, against one process on the whole
batch: a parameter whose gradient is stale on a rank (its backward did not reach it) counts as zeros there, and is
updated on every rank when any rank's backward reached it; unused on every rank, it is skipped as gluon skips it
(ignore_stale_grad=True), its gradient left as it was, or is gluon's UserWarning on every rank. Before, the stale
rank sent its last gradient and skipped the update while the others applied it: the ranks' parameters drifted apart.

The ranks' flags (which gradients any rank computed) travel in a bucket that is sent anyway: every steady step costs
the engine one allreduce request and one collective per bucket, no more (before: one more request and collective per
step, the flags' own). Also with u's gradient in a float16 bucket and the flags in w's float32 one, with every
gradient (and so the flags) in one float16 bucket, and with fp16 compression and a gradient_predivide_factor."""

import numpy as np

import aiacc.mxnet as hvd
import mxnet as mx
from mxnet import autograd, gluon, nd

from report import raises, say

hvd.init()
r, n = hvd.rank(), hvd.size()
ROWS = 4  # per rank
rng = np.random.default_rng(5)
X = rng.standard_normal((8, n * ROWS, 5)).astype(np.float32)
# which ranks' rows use the parameter u in each step: all, some of them, none
ALL = set(range(n))
USES = [{0}, ALL, set(), {n - 1}, {0, n - 1}, {0}, set(), ALL]
checks = 0


def _as(a, dtype):
    return a if a.dtype == np.dtype(dtype) else a.astype(dtype)


class Gated(gluon.Block):
    """w on every row; u only on the rows of the ranks that use it this step (each of its own ``dtypes``)."""

    def __init__(self, dtypes=("float32", "float32"), **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.w = self.params.get("w", shape=(5,), dtype=dtypes[0], init=mx.init.Constant(0.5))
            self.u = self.params.get("u", shape=(5,), dtype=dtypes[1], init=mx.init.Constant(0.25))

    def forward(self, x, rows_of, uses):
        out = []
        for k in rows_of:
            xs = x[(k - rows_of[0]) * ROWS:(k - rows_of[0] + 1) * ROWS]
            y = _as(nd.broadcast_mul(_as(xs, self.w.dtype), self.w.data()), "float32")
            if k in uses:
                y = y + _as(nd.broadcast_mul(_as(nd.tanh(xs), self.u.dtype), self.u.data()), "float32")
            out.append(y)
        return nd.concat(*out, dim=0)


def requests_and_collectives():
    s = hvd.summary()
    return np.array([s["allreduce_requests"], s["allreduces"]])


def train(grad_req, split, dtypes=("float32", "float32"), tol=(1e-5, 1e-6), zero=True, **options):
    """One case: DistributedTrainer on this rank's rows vs gluon.Trainer on every row; equal after each step
    (within ``tol``, rtol and atol), and each step after the first costs one request and one collective per
    bucket (the tiny gradients: one bucket per dtype)."""
    global checks
    case = f"{grad_req}{split}{dtypes[0][-2:]}{dtypes[1][-2:]}{''.join(options)}{'' if zero else 'kept'}"
    nets = [Gated(dtypes, prefix=f"{case}_{i}_") for i in range(2)]
    for net in nets:
        net.initialize()
        for p in net.collect_params().values():
            p.grad_req = grad_req
    opt = {"learning_rate": 0.1, "momentum": 0.9}  # momentum: a skipped update differs from one with zeros
    dist = hvd.DistributedTrainer(nets[0].collect_params(), "sgd", dict(opt), **options)
    ref = gluon.Trainer(nets[1].collect_params(), "sgd", dict(opt), kvstore=None)
    for step, uses in enumerate(USES):
        for net, trainer, ranks in ((nets[0], dist, [r]), (nets[1], ref, list(range(n)))):
            x = nd.array(X[step, ranks[0] * ROWS:(ranks[-1] + 1) * ROWS])
            for _ in range(2 if grad_req == "add" else 1):  # 'add': two backward passes per step
                with autograd.record():
                    loss = (net(x, ranks, uses) ** 2).sum()
                loss.backward()
            batch = ROWS * len(ranks)
            before = net.u.grad().asnumpy()
            counts = requests_and_collectives()
            if split and trainer is dist:
                trainer.allreduce_grads()
                trainer.update(batch, ignore_stale_grad=True)
            else:
                trainer.step(batch, ignore_stale_grad=True)
            if trainer is dist and step:  # (the first step settles the buckets: collectives of its own)
                sent = (requests_and_collectives() - counts).tolist()
                # (the second update also compares the parameters across the ranks, once: one allreduce more)
                assert sent == [len(set(dtypes)) + (step == 1)] * 2, \
                    f"{case} step {step}: {sent[0]} requests, {sent[1]} collectives for {len(set(dtypes))} buckets"
                checks += 1
            if trainer is dist and not uses and grad_req == "write":  # stale everywhere: its gradient is left as it was, as gluon does
                assert np.array_equal(net.u.grad().asnumpy(), before), f"step {step}: u's stale gradient changed"
                checks += 1
            if grad_req == "add" and zero:
                net.collect_params().zero_grad()
        for name in ("w", "u"):
            a, b = getattr(nets[0], name).data().asnumpy(), getattr(nets[1], name).data().asnumpy()
            assert np.allclose(a, b, rtol=tol[0], atol=tol[1]), \
                f"{case} step {step} (u used by ranks {sorted(uses)}): {name} {a} != reference {b}"
            rows = hvd.allgather(getattr(nets[0], name).data().reshape((1, -1)), name=f"check.{name}").asnumpy()
            assert all(np.array_equal(rows[0], row) for row in rows[1:]), f"step {step}: {name} differs across ranks"
            checks += 1
    assert not np.allclose(nets[0].u.data().asnumpy(), 0.25), "u did not train"


train("write", False)
train("write", True)
train("add", False)
# 'add' never zeroed: a stale rank's gradient carries its share of the earlier steps' total (it was zeroed: the
# total lost (size - 1) / size of it, u drifted from one process)
train("add", True, zero=False)
train("write", False, ("float32", "float16"), tol=(1e-3, 1e-3))  # u in a float16 bucket, the flags in w's
train("write", True, ("float16", "float16"), tol=(1e-3, 1e-3))  # the flags in a float16 bucket
train("write", False, tol=(1e-3, 1e-3), compression=hvd.Compression.fp16, gradient_predivide_factor=2.0)
say(f"TRAIN_OK rank={r}")

# without ignore_stale_grad: a parameter that some rank's backward reached is fresh on every rank; one that no
# rank's reached is gluon's UserWarning, on every rank
net = Gated(prefix="strict_")
net.initialize()
trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
x = nd.array(X[0, r * ROWS:(r + 1) * ROWS])
for uses in ({0, 1}, {1}):
    with autograd.record():
        loss = (net(x, [r], uses) ** 2).sum()
    loss.backward()
    trainer.step(ROWS)
    checks += 1
with autograd.record():
    loss = (net(x, [r], set()) ** 2).sum()
loss.backward()
raises(UserWarning, lambda: trainer.step(ROWS), "strict_u")
checks += 1

# parameters named differently on each rank: the buckets' error on every rank, and nothing left waiting (the freshness
# flags travel under a name every rank gives them)
odd = gluon.nn.Dense(2, in_units=3, prefix=f"rank{r}_")
odd.initialize()
odd_trainer = hvd.DistributedTrainer(odd.collect_params(), "sgd", {"learning_rate": 0.1})
with autograd.record():
    loss = odd(nd.ones((2, 3))).sum()
loss.backward()
raises(hvd.TensorMismatchError, lambda: odd_trainer.step(2), "'grad.rank0_weight'", "'grad.rank1_weight'")
checks += 1
hvd.barrier()
say(f"OK rank={r} checks={checks}")
