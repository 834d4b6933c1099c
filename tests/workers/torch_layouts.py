"""DistributedOptimizer on parameters that are not row-major (a channels_last convolution, a transposed weight)
under torch's fused optimizers, and under torch's compiled-optimizer recipe (torch.compile(opt.step), and a
compiled function that calls opt.step()): each equal to one process on the whole batch (every rank computes the
reference)."""

import torch

import aiacc.torch as hvd
from report import say

hvd.init()
torch.set_num_threads(1)
r, n = hvd.rank(), hvd.size()
checks = 0


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(2, 4, 3)
        # a transposed weight: dense, column-major
        self.w = torch.nn.Parameter(torch.randn(3, 16).t())

    def forward(self, x):
        return torch.tanh(self.conv(x)).flatten(1) @ self.w


def made():
    return Net().to(memory_format=torch.channels_last)


def same(what, model, ref, tol=1e-6):
    global checks
    worst = max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
    assert worst <= tol, f"rank {r}: {what}: {worst:.3g} from the one-process reference"
    checks += 1


g = torch.Generator().manual_seed(1)
x = torch.randn(2 * n, 2, 4, 4, generator=g).to(memory_format=torch.channels_last)
mine = slice(2 * r, 2 * r + 2)
assert made().conv.weight.stride() == (18, 1, 6, 2) and made().w.stride() == (1, 16)

for make in (lambda ps: torch.optim.Adam(ps, lr=0.05, fused=True), lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True),
             lambda ps: torch.optim.Adam(ps, lr=0.05, foreach=True)):
    model, ref = made(), made()
    opt = hvd.DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters())
    ref_opt = make(ref.parameters())
    for step in range(3):
        opt.zero_grad()
        model(x[mine]).square().mean().backward()
        opt.step()
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
        same(f"{type(ref_opt).__name__} step {step}", model, ref)
    # the gradients torch's fused kernels read are laid out as their parameters (DDP's bucket views are)
    for p in model.parameters():
        assert p.grad.stride() == p.stride(), (p.grad.stride(), p.stride())
    checks += 1

# torch's compiled-optimizer recipe: the wrapper's step runs as it is (it waits for aiacc's engine)
model, ref = made(), made()
opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.05), named_parameters=model.named_parameters())
ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
step = torch.compile(opt.step, backend="aot_eager")


@torch.compile(backend="aot_eager")
def train_step(batch):
    opt.zero_grad()
    model(batch).square().mean().backward()
    opt.step()


for k in range(4):
    if k < 2:
        opt.zero_grad()
        model(x[mine]).square().mean().backward()
        step()
    else:
        train_step(x[mine])
    ref_opt.zero_grad()
    ref(x).square().mean().backward()
    ref_opt.step()
    same(f"compiled step {k}", model, ref)

say(f"OK rank={r} checks={checks}")
