"""The MXNet replay trains under aiacc.mxnet's DistributedTrainer to the closed form.

Each rank feeds x = rank + 1; after STEPS plain-SGD steps from zero every parameter of layer i is
-LR * STEPS * coeff_i * mean(rank + 1), and the layers asked for their (dilated) times.
Usage: mx_replay.py PROFILE DILATE
"""

import sys

import aiacc.mxnet as hvd
import mxnet as mx  # noqa: F401 - after aiacc.mxnet (numpy.bool)
from mxnet import autograd, nd

from aiacc.bench.replay import layer_coefficient, load_profile
from aiacc.bench.replay_mxnet import build_model
from report import say

hvd.init()
r, n = hvd.rank(), hvd.size()
STEPS, LR = 3, 0.5
profile = load_profile(sys.argv[1])
dilate = float(sys.argv[2])
model = build_model(profile, dilate)
params = model.replay_params
assert [p.shape for p in params] == [tuple(shape) for _, shape in profile.tensors]
trainer = hvd.DistributedTrainer(model.collect_params(), "sgd", {"learning_rate": LR})
x = nd.full((8,), float(r + 1))
checks = 1
for _ in range(STEPS):
    with autograd.record():
        loss = model(x).mean()
    loss.backward()
    trainer.step(1)
assert model.clock.sleeps == STEPS * 2 * len(profile.layers), model.clock.sleeps
want = STEPS * dilate * profile.compute_ms * 1e-3
assert abs(model.clock.requested_s - want) < 1e-9 * max(1.0, want)
checks += 1
mean_input = sum(range(1, n + 1)) / n
index = [i for i, lay in enumerate(profile.layers) for _ in lay.params]
for i, p in zip(index, params):
    expect = -LR * STEPS * layer_coefficient(i) * mean_input
    got = p.data().asnumpy()
    assert expect != 0 and (got == expect).all(), (p.name, got.flat[:3], expect)
    checks += 1
say(f"OK rank={r} checks={checks}")
hvd.shutdown()
