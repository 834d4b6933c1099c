"""aiacc.torch.SyncBatchNorm equals one nn.BatchNorm over the global batch: outputs, input gradients and
running statistics, for 1d/2d/3d inputs, uneven per-rank batch sizes (one rank's may be empty), and
momentum=None; a model converted with convert_sync_batchnorm and trained with DistributedOptimizer ends
with the parameters of the plain model trained on the whole batch in one process."""

import torch
import torch.nn as nn

import aiacc.torch as hvd
from report import raises, say

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
checks = 0


def close(what, got, want, tol=1e-5):
    global checks
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.allclose(got, want, rtol=tol, atol=tol), f"{what} on rank {r}: max err {(got - want).abs().max()}"
    checks += 1


def data(rows_of, shape, seed):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(rows_of(k), *shape, generator=g, dtype=torch.float64) for k in range(n)]
    return xs, torch.cat(xs)


cases = [  # (module, per-sample shape, rows of rank k, momentum)
    (nn.BatchNorm1d, (4,), lambda k: 3, 0.1),
    (nn.BatchNorm1d, (4, 5), lambda k: k + 2, 0.1),  # uneven
    (nn.BatchNorm2d, (3, 4, 4), lambda k: 2 * k + 1, None),  # uneven, cumulative running average
    (nn.BatchNorm3d, (2, 3, 2, 2), lambda k: 2, 0.3),
    (nn.BatchNorm2d, (3, 2, 2), lambda k: 0 if k == 0 else 3, 0.1),  # rank 0 has an empty batch
]
for i, (cls, shape, rows_of, momentum) in enumerate(cases):
    ref = cls(shape[0], momentum=momentum).double()
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(i))
        ref.bias.uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(i + 50))
    sync = hvd.SyncBatchNorm.convert_sync_batchnorm(cls(shape[0], momentum=momentum).double())
    assert isinstance(sync, hvd.SyncBatchNorm)
    sync.load_state_dict(ref.state_dict())
    for step in range(3):
        xs, whole = data(rows_of, shape, 10 * i + step)
        mine = xs[r].clone().requires_grad_(True)
        every = whole.clone().requires_grad_(True)
        weights = torch.linspace(-1, 1, whole[0].numel(), dtype=torch.float64).view(whole.shape[1:])
        out = sync(mine)
        want = ref(every)
        # the same loss over the global batch: each rank backpropagates its rows' part of it
        (out * weights).sum().backward()
        (want * weights).sum().backward()
        start = sum(rows_of(k) for k in range(r))
        close(f"case {i} step {step} output", out.detach(), want.detach()[start:start + rows_of(r)])
        close(f"case {i} step {step} input gradient", mine.grad, every.grad[start:start + rows_of(r)])
    close(f"case {i} running_mean", sync.running_mean, ref.running_mean)
    close(f"case {i} running_var", sync.running_var, ref.running_var)
    sync.eval()
    ref.eval()
    x = data(lambda k: 2, shape, 99)[0][r]
    close(f"case {i} eval output", sync(x), ref(x))

# eval mode without running statistics: the global batch's statistics, as Horovod's (before: each rank's own
# batch, as torch's nn.SyncBatchNorm), equal to one BatchNorm over the whole batch
local, sync = nn.BatchNorm2d(3, track_running_stats=False).double(), hvd.SyncBatchNorm(3, track_running_stats=False)
sync.double().load_state_dict(local.state_dict())
xs, whole = data(lambda k: k + 2, (3, 2, 2), 98)
start = sum(k + 2 for k in range(r))
close("eval without running statistics", sync.eval()(xs[r]), local.eval()(whole)[start:start + r + 2])
# the input needs a gradient on rank 0 only (its weight on every rank): every rank takes part in the backward's
# allreduce, so rank 0's input gradient is the global one (before, the other ranks skipped it: rank 0 waited for ever)
ref, sync = nn.BatchNorm1d(3).double(), hvd.SyncBatchNorm(3).double()
xs, whole = data(lambda k: 2, (3,), 97)
every = whole.clone().requires_grad_(True)
mine = xs[r].clone().requires_grad_(r == 0)
(sync(mine) * torch.arange(3.0, dtype=torch.float64)).sum().backward()
(ref(every) * torch.arange(3.0, dtype=torch.float64)).sum().backward()
if r == 0:
    close("input gradient, needed on rank 0 only", mine.grad, every.grad[:2])
else:
    assert mine.grad is None
    checks += 1
close("weight gradient, summed", hvd.allreduce(sync.weight.grad, op=hvd.Sum), ref.weight.grad)
# ... and where another rank has no backward at all (a frozen layer and an input without gradient): an error in
# the forward, on every rank, naming the ranks
frozen = hvd.SyncBatchNorm(3).double().requires_grad_(r == 0)
raises(ValueError, lambda: frozen(xs[r].clone().requires_grad_(r == 0)), "needs a gradient on rank 0",
       f"on rank{'s' if n > 2 else ''} {', '.join(map(str, range(1, n)))} neither")
checks += 1
raises(ValueError, lambda: hvd.SyncBatchNorm(3)(torch.ones(3)), "at least 2 dimensions", "shape (3,)")
raises(ValueError, lambda: hvd.SyncBatchNorm(3)(torch.ones(2, 4)), "input has 4 channels")
checks += 2


def net(sync):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                      nn.Linear(4 * 6 * 6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)).double()
    return hvd.SyncBatchNorm.convert_sync_batchnorm(m) if sync else m


BATCH = 6 * n
g = torch.Generator().manual_seed(5)
batches = [(torch.randn(BATCH, 1, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (BATCH,), generator=g))
           for _ in range(6)]
ref, model = net(False), net(True)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               named_parameters=model.named_parameters())
rows = slice(r * BATCH // n, (r + 1) * BATCH // n)
for x, y in batches:
    ref_opt.zero_grad()
    nn.functional.cross_entropy(ref(x), y).backward()
    ref_opt.step()
    opt.zero_grad()
    nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
    opt.step()
for (name, p), q in zip(model.state_dict().items(), ref.state_dict().values()):
    if p.is_floating_point():
        close(f"trained {name}", p, q)
# a layer run after another rank called join(): refused, saying so (it said the ranks' channels differed)
if r == 0:
    hvd.join()
else:
    raises(hvd.TensorMismatchError, lambda: hvd.SyncBatchNorm(3).double()(torch.ones(2, 3, dtype=torch.float64)),
           "SyncBatchNorm: tensor 'SyncBatchNorm.forward.", "rank 0 has called join()")
    hvd.join()
checks += 1
say(f"OK rank={r} checks={checks}")
