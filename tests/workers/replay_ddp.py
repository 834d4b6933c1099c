"""A replay model trains the same under aiacc's DistributedOptimizer and DDP (gloo), and as predicted.

Each rank feeds x = rank + 1 (so mean(x) differs by rank); every gradient element of layer i is
then layer_coefficient(i) * (rank + 1) and the average over ranks is known in closed form: after
STEPS plain-SGD steps from zero every parameter of layer i is -LR * STEPS * coeff_i * mean(rank + 1).
Usage: replay_ddp.py PROFILE DILATE keep|none  (gradients kept between steps, or set to None)
"""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import aiacc.torch as hvd
from aiacc.bench.replay import build_model, layer_coefficient, load_profile
from report import say

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
dist.init_process_group("gloo", rank=r, world_size=n)  # env:// from aiaccrun
STEPS, LR = 3, 0.5
profile = load_profile(sys.argv[1])
dilate = float(sys.argv[2])
set_to_none = sys.argv[3] == "none"
x = torch.full((8,), float(r + 1))

aiacc_model = build_model(profile, dilate)
aiacc_opt = hvd.DistributedOptimizer(torch.optim.SGD(aiacc_model.parameters(), lr=LR),
                                     named_parameters=aiacc_model.named_parameters())
ddp_model = build_model(profile, dilate)
ddp = nn.parallel.DistributedDataParallel(ddp_model)
ddp_opt = torch.optim.SGD(ddp.parameters(), lr=LR)
# overlap_forward: each layer's update is applied in the forward pre-hook of its parameters' modules
fwd_model = build_model(profile, dilate)
fwd_opt = hvd.DistributedOptimizer(torch.optim.SGD(fwd_model.parameters(), lr=LR), overlap_forward=True,
                                   named_parameters=[(f"fwd.{k}", p) for k, p in fwd_model.named_parameters()])
applied_in_forward = []
checks = 0
for model, opt in ((aiacc_model, aiacc_opt), (ddp, ddp_opt), (fwd_model, fwd_opt)):
    for step in range(STEPS):
        opt.zero_grad(set_to_none=set_to_none)
        if model is fwd_model and step > 0:
            # last step's updates are still pending; the forward applies them layer by layer
            first = next(fwd_model.parameters())
            before = first.detach().clone()
            out = model(x)
            applied_in_forward.append(not torch.equal(before, first.detach()))
            out.mean().backward()
        else:
            model(x).mean().backward()
        opt.step()
    if model is fwd_model:
        opt.synchronize()  # the last step's updates
        assert applied_in_forward and all(applied_in_forward), applied_in_forward
        checks += 1
    clock = (model.module if model is ddp else model).clock
    # what the layers asked for: every layer's forward and backward once per step, dilated
    assert clock.sleeps == STEPS * 2 * len(profile.layers), clock.sleeps
    want = STEPS * dilate * profile.compute_ms * 1e-3
    assert abs(clock.requested_s - want) < 1e-9 * max(1.0, want), (clock.requested_s, want)
    checks += 2

mean_input = sum(range(1, n + 1)) / n
index = {name: i for i, lay in enumerate(profile.layers) for name, _ in lay.params}
a_params, d_params = dict(aiacc_model.named_parameters()), dict(ddp_model.named_parameters())
f_params = dict(fwd_model.named_parameters())
assert list(a_params) == list(d_params) == list(f_params) == [name for name, _ in profile.tensors]
for name, shape in profile.tensors:
    a, d = a_params[name].detach(), d_params[name].detach()
    assert torch.equal(a, f_params[name].detach()), name
    assert tuple(a.shape) == tuple(shape)
    want = -LR * STEPS * layer_coefficient(index[name]) * mean_input
    assert want != 0 and torch.equal(a, torch.full_like(a, want)), (name, a.flatten()[:3], want)
    assert torch.allclose(a, d, rtol=1e-6, atol=0), (name, a.flatten()[:3], d.flatten()[:3])
    checks += 1
dist.destroy_process_group()
say(f"OK rank={r} checks={checks}")
hvd.shutdown()
