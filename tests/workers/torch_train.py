"""Data-parallel training with DistributedOptimizer equals one process on the whole batch.

Every rank trains on its shard of each global batch; every rank also trains a reference copy
of the same model on the whole batch in plain torch (no aiacc), and compares after 20 steps.
Usage: torch_train.py (set AIACC_TIMELINE to also run the overlap case, tracks named ``tl.*``).
"""

import sys

import torch
import torch.nn as nn

import aiacc.torch as hvd
from report import say

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
STEPS, BATCH = 20, 24  # 24 rows split evenly over 2, 3 or 4 ranks


def small_cnn(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 16), nn.Tanh(), nn.Linear(16, 10)).to(dtype)


def batches(dtype, count, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 1, 8, 8, generator=g).to(dtype), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(count)]


def make_opt(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    return torch.optim.Adam(params, lr=0.01)


def train(kind, dtype, passes, distributed, tag, compression=None):
    model = small_cnn(dtype)
    opt = make_opt(kind, model.parameters())
    if distributed:
        opt = hvd.DistributedOptimizer(opt, named_parameters=[(f"{tag}.{k}", p) for k, p in model.named_parameters()],
                                       compression=compression, backward_passes_per_step=passes)
    data = batches(dtype, STEPS * passes)
    rows = slice(r * BATCH // n, (r + 1) * BATCH // n) if distributed else slice(0, BATCH)
    for step in range(STEPS):
        opt.zero_grad()
        for x, y in data[step * passes:(step + 1) * passes]:
            # Horovod's semantics: the k passes are summed locally, then averaged over ranks; the
            # reference sums the same k full-batch gradients.
            nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()
    if distributed:
        opt.remove_hooks()
    return [p.detach().clone() for p in model.parameters()]


def worst_relative(got, want):
    return max(float((a.double() - b.double()).norm() / b.double().norm()) for a, b in zip(got, want))


def same_on_every_rank(params, what):
    everyone = hvd.allgather_object([p for p in params])
    for k, theirs in enumerate(everyone):
        for a, b in zip(theirs, everyone[0]):
            assert torch.equal(a, b), f"{what}: rank {k}'s parameters differ from rank 0's"


for kind in ("sgd", "adam"):
    for passes in (1, 2):
        tag = f"{kind}{passes}"
        got = train(kind, torch.float64, passes, True, tag)
        want = train(kind, torch.float64, passes, False, tag)
        err = worst_relative(got, want)
        assert err <= 1e-6, f"{tag}: parameters differ from the single-process reference by {err:.3g} (relative)"
        moved = worst_relative(want, [p.detach() for p in small_cnn(torch.float64).parameters()])
        assert moved > 1e-2, f"{tag}: training did not change the parameters ({moved})"
        same_on_every_rank(got, tag)
        say(f"MATCH rank={r} {kind} backward_passes_per_step={passes} relative_error={err:.2e}")

# a parameter that only rank 0 uses (dynamic control flow): the other ranks never produce its gradient,
# its bucket is sent with their zeros, and the average equals the whole batch's gradient
class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.trunk, self.branch = nn.Linear(5, 3), nn.Linear(5, 3)

    def forward(self, x, flagged):
        out = self.trunk(x)
        if flagged.any():  # only the first rows take the branch: they all lie in rank 0's shard
            out = out + torch.zeros_like(out).index_add(0, flagged.nonzero()[:, 0], self.branch(x[flagged]))
        return out


def train_gated(distributed):
    model = Gated()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if distributed:
        opt = hvd.DistributedOptimizer(opt, named_parameters=[(f"gated.{k}", p) for k, p in model.named_parameters()])
    g = torch.Generator().manual_seed(5)
    rows = slice(r * BATCH // n, (r + 1) * BATCH // n) if distributed else slice(0, BATCH)
    for _ in range(6):
        x, y = torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 3, generator=g)
        flagged = torch.arange(BATCH) < BATCH // n // 2
        opt.zero_grad()
        nn.functional.mse_loss(model(x[rows], flagged[rows]), y[rows]).backward()
        opt.step()
    if distributed:
        opt.remove_hooks()
    return [p.detach().clone() for p in model.parameters()]


got, want = train_gated(True), train_gated(False)
err = worst_relative(got, want)
assert err <= 1e-5, f"a parameter unused on some ranks: parameters differ from the reference by {err:.3g}"
assert worst_relative(got[2:], [p.detach() for p in Gated().parameters()][2:]) > 1e-3, "the branch did not train"
same_on_every_rank(got, "gated")
say(f"UNUSED rank={r} relative_error={err:.2e}")

# fp16 on the wire: float32 model against the float32 reference
got = train("sgd", torch.float32, 1, True, "fp16", compression=hvd.Compression.fp16)
want = train("sgd", torch.float32, 1, False, "fp16")
err = worst_relative(got, want)
same_on_every_rank(got, "fp16")
say(f"FP16 rank={r} relative_error={err:.2e}")
assert err <= 2e-3, f"fp16 compression: relative error {err:.3g} exceeds 2e-3"


# overlap: the timeline shows when what ran. AIACC_BUCKET_CAP (set by the test) puts the dense layers in
# one bucket and the convolutions in another; between them sits a layer whose backward takes 30 ms (as
# a large layer's would), so the first bucket is complete long before the second.
class SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import time
        time.sleep(0.03)
        return grad


class Slow(nn.Module):
    def forward(self, x):
        return SlowBackward.apply(x)


def overlap_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), Slow(), nn.Linear(32 * 8 * 8, 64), nn.ReLU(),
                         nn.Linear(64, 10))


model = overlap_model()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=[(f"tl.{k}", p) for k, p in model.named_parameters()])
g = torch.Generator().manual_seed(r)
for step in range(8):
    opt.zero_grad()
    if step == 1:
        say(f"BUCKETS rank={r} {opt._aiacc_buckets.describe()}")
    x, y = torch.randn(32, 3, 16, 16, generator=g), torch.randint(0, 10, (32,), generator=g)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
say(f"OK rank={r}")
hvd.shutdown()
sys.exit(0)
