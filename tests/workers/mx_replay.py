"""The MXNet replay trains under aiacc.mxnet's DistributedTrainer to the closed form.

Each rank feeds x = rank + 1; after STEPS plain-SGD steps from zero every parameter of layer i is
-LR * STEPS * coeff_i * mean(rank + 1), and the layers asked for their (dilated) times.
Usage: mx_replay.py PROFILE DILATE
"""

import sys

import aiacc.mxnet as hvd
import mxnet as mx  # noqa: F401 - after aiacc.mxnet (numpy.bool)
from mxnet import autograd, nd

from aiacc.bench.replay import load_profile
from aiacc.bench.replay_mxnet import build_model
from report import check_replay, say

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
checks += check_replay(model.clock, profile, dilate, STEPS, LR, n, [(p.name, p.data().asnumpy()) for p in params])
say(f"OK rank={r} checks={checks}")
hvd.shutdown()
