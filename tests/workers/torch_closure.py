"""DistributedOptimizer with step(closure) where the optimizer decides on the loss (LBFGS with a strong-Wolfe
line search), and two optimizers made without named_parameters over parts of one model, each equal to one
process on the whole batch (every rank computes the reference)."""

import copy

import torch

import aiacc.torch as hvd
from report import say

hvd.init()
torch.set_num_threads(1)
r, n = hvd.rank(), hvd.size()
checks = 0


def mlp(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(dtype)


def same(what, model, ref, tol):
    global checks
    worst = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
    assert worst <= tol, f"rank {r}: {what}: {worst:.3g} from the one-process reference"
    checks += 1


g = torch.Generator().manual_seed(1)
x, y = torch.randn(4 * n, 6, generator=g, dtype=torch.float64), torch.randn(4 * n, 2, generator=g, dtype=torch.float64)
mine = slice(4 * r, 4 * r + 4)

# LBFGS' line search evaluates the closure's loss: each rank must see the average (its own split the ranks apart,
# then one made more closure calls than the other and the job stalled)
model = mlp(torch.float64)
ref = copy.deepcopy(model)
lbfgs = lambda ps: torch.optim.LBFGS(ps, lr=1, max_iter=5, line_search_fn="strong_wolfe")  # noqa: E731
opt = hvd.DistributedOptimizer(lbfgs(model.parameters()), named_parameters=model.named_parameters())
ref_opt = lbfgs(ref.parameters())


def closure():
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
    loss.backward()
    return loss


def ref_closure():
    ref_opt.zero_grad()
    loss = torch.nn.functional.mse_loss(ref(x), y)
    loss.backward()
    return loss


for step in range(3):
    loss = opt.step(closure)
    ref_loss = ref_opt.step(ref_closure)
    assert abs(float(loss) - float(ref_loss)) < 1e-10, (step, float(loss), float(ref_loss))
    same(f"LBFGS step {step}", model, ref, 1e-10)
opt.remove_hooks()

# two optimizers without named_parameters, one backward for both (they used to share gradient names)
model = mlp(torch.float32)
ref = copy.deepcopy(model)
first = hvd.DistributedOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1))
second = hvd.DistributedOptimizer(torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9))
ref_opts = [torch.optim.SGD(ref[0].parameters(), lr=0.1), torch.optim.SGD(ref[2].parameters(), lr=0.1, momentum=0.9)]
for step in range(3):
    for o in (first, second, *ref_opts):
        o.zero_grad()
    torch.nn.functional.mse_loss(model(x[mine].float()), y[mine].float()).backward()
    torch.nn.functional.mse_loss(ref(x.float()), y.float()).backward()
    for o in (first, second, *ref_opts):
        o.step()
    same(f"two unnamed optimizers, step {step}", model, ref, 1e-5)
say(f"OK rank={r} checks={checks}")
