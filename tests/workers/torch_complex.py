"""Complex parameters and tensors under aiacc.torch, each result against a one-process reference computed on
every rank: DistributedOptimizer over a model mixing complex and real parameters (SGD with momentum, Adam,
backward_passes_per_step=2) equals one process on the whole batch; allreduce / allgather / broadcast of complex
tensors; broadcast_parameters / broadcast_optimizer_state with complex state; DDP on the aiacc backend equals DDP
on gloo in the same job; Min / Max / Product refused by name.
"""

import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

import aiacc.torch as hvd
from report import raises, say

warnings.filterwarnings("ignore", "Complex modules are a new feature")
torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
STEPS, BATCH = 8, 12  # 12 rows split evenly over 2 or 3 ranks
checks = 0


class Mixed(nn.Module):
    """A complex layer (complex64 weight and bias) between real ones: the loss is real."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 6).to(dtype)
        self.cplx = nn.Linear(6, 5).to(torch.complex64 if dtype == torch.float32 else torch.complex128)
        self.out = nn.Linear(10, 3).to(dtype)

    def forward(self, x):
        z = self.cplx(self.inp(x).to(self.cplx.weight.dtype))
        return self.out(torch.cat([z.real, z.imag], dim=1))


def batches(dtype, count):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 4, generator=g).to(dtype), torch.randn(BATCH, 3, generator=g).to(dtype))
            for _ in range(count)]


def train(kind, dtype, passes, distributed, tag):
    model = Mixed(dtype)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9) if kind == "sgd" else torch.optim.Adam(params, lr=0.01)
    if distributed:
        opt = hvd.DistributedOptimizer(opt, named_parameters=[(f"{tag}.{k}", p) for k, p in model.named_parameters()],
                                       backward_passes_per_step=passes)
    data = batches(dtype, STEPS * passes)
    rows = slice(r * BATCH // n, (r + 1) * BATCH // n) if distributed else slice(0, BATCH)
    for step in range(STEPS):
        opt.zero_grad()
        for x, y in data[step * passes:(step + 1) * passes]:
            nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
    if distributed:
        opt.remove_hooks()
    return model, opt


def worst_relative(got, want):
    return max(float((a - b).abs().norm() / b.abs().norm()) for a, b in zip(got, want))


for dtype, tol in ((torch.float32, 2e-5), (torch.float64, 1e-10)):
    for kind in ("sgd", "adam"):
        for passes in (1, 2):
            tag = f"{kind}{passes}.{str(dtype)[6:]}"
            got = [p.detach().clone() for p in train(kind, dtype, passes, True, tag)[0].parameters()]
            want = [p.detach().clone() for p in train(kind, dtype, passes, False, tag)[0].parameters()]
            assert got[2].is_complex() and not got[0].is_complex(), [p.dtype for p in got]
            err = worst_relative(got, want)
            assert err <= tol, f"{tag}: parameters differ from the one-process reference by {err:.3g} (relative)"
            moved = worst_relative(want, [p.detach() for p in Mixed(dtype).parameters()])
            assert moved > 1e-2, f"{tag}: training did not change the parameters ({moved})"
            everyone = hvd.allgather_object(got)
            assert all(torch.equal(a, b) for theirs in everyone for a, b in zip(theirs, got)), f"{tag}: ranks differ"
            checks += 1

# ---- collectives of complex tensors -------------------------------------------------------------


def of(k, shape=(3, 4), dtype=torch.complex64, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + k)
    return torch.complex(torch.rand(shape, generator=g, dtype=torch.float64) + 0.5,
                         torch.rand(shape, generator=g, dtype=torch.float64) - 0.5).to(dtype)


def close(name, got, want, tol):
    global checks
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, want.dtype, got.shape, want.shape)
    assert torch.allclose(got, want, rtol=tol, atol=tol), f"{name}: max err {(got - want).abs().max()}"
    checks += 1


for seed, (dtype, tol) in enumerate(((torch.complex64, 1e-6), (torch.complex128, 1e-12))):
    name = str(dtype)[6:]
    xs = [of(k, dtype=dtype, seed=seed) for k in range(n)]
    total = torch.stack([x.to(torch.complex128) for x in xs]).sum(0)
    mine = xs[r].clone()
    close(f"allreduce Sum {name}", hvd.allreduce(mine, op=hvd.Sum, name=f"c.sum.{name}"), total.to(dtype), tol)
    close(f"allreduce Average {name}", hvd.allreduce(mine, name=f"c.avg.{name}"), (total / n).to(dtype), tol)
    close(f"allreduce scaled {name}", hvd.allreduce(mine, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0,
                                                    name=f"c.scaled.{name}"), (total * 1.5).to(dtype), tol)
    inplace = xs[r].clone()
    hvd.allreduce_(inplace, op=hvd.Sum, name=f"c.inplace.{name}")
    close(f"allreduce_ {name}", inplace, total.to(dtype), tol)
    g = hvd.grouped_allreduce([xs[r], xs[r].real.contiguous()], op=hvd.Average, name=f"c.group.{name}")
    close(f"grouped complex {name}", g[0], (total / n).to(dtype), tol)
    close(f"grouped real {name}", g[1], (total.real / n).to(g[1].dtype), tol)
    # autograd through the allreduce: the gradient of a sum is the sum of the gradients
    leaf = xs[r].clone().requires_grad_()
    hvd.allreduce(leaf, op=hvd.Sum, name=f"c.grad.{name}").abs().sum().backward()
    assert leaf.grad is not None and leaf.grad.dtype == dtype
    checks += 1
    parts = [of(k, (k + 1, 2), dtype, seed + 10) for k in range(n)]
    close(f"allgather {name}", hvd.allgather(parts[r], name=f"c.ag.{name}"), torch.cat(parts), tol)
    for root in range(n):
        close(f"broadcast {root} {name}", hvd.broadcast(mine, root, name=f"c.bc.{root}.{name}"), xs[root], 0)
    got = hvd.reducescatter(of(r, (2 * n, 3), dtype, seed + 20), op=hvd.Sum, name=f"c.rs.{name}")
    want = torch.stack([of(k, (2 * n, 3), dtype, seed + 20) for k in range(n)]).sum(0)[2 * r:2 * r + 2]
    close(f"reducescatter {name}", got, want, tol)
    # a conjugate view (x.conj(): torch's lazy conjugation, which numpy() refuses) is its values, in place too
    close(f"allreduce conj {name}", hvd.allreduce(mine.conj(), op=hvd.Sum, name=f"c.conj.{name}"),
          total.conj().to(dtype), tol)
    view = xs[r].clone().conj()
    hvd.allreduce_(view, op=hvd.Sum, name=f"c.conj_.{name}")
    close(f"allreduce_ conj {name}", view, total.conj().to(dtype), tol)
    close(f"allgather conj {name}", hvd.allgather(mine.conj(), name=f"c.conj.ag.{name}"),
          torch.cat([x.conj() for x in xs]).resolve_conj(), 0)
    close(f"allreduce negated view {name}", hvd.allreduce(mine.conj().imag, op=hvd.Sum, name=f"c.neg.{name}"),
          -total.imag.to(mine.real.dtype), tol)  # (x.conj().imag: a real view with torch's negative bit)
    view = xs[r].clone().conj()
    hvd.broadcast_(view, n - 1, name=f"c.conj.bc.{name}")
    close(f"broadcast_ conj {name}", view, xs[n - 1].conj(), 0)
    for op in (hvd.Min, hvd.Max, hvd.Product):
        msg = raises(TypeError, lambda: hvd.allreduce(mine, op=op, name=f"c.bad.{op}"),
                     f"allreduce of tensor 'c.bad.{op}': op={op} is not defined for complex tensors ({name})")
        say(f"ERROR-SEEN rank={r}: {msg}")
        checks += 1

# ---- broadcast_parameters / broadcast_optimizer_state with complex state --------------------------
model, opt = train("adam", torch.float32, 1, False, "state")
if r != 0:  # other ranks start elsewhere: the broadcasts must bring rank 0's parameters and Adam state
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(r + 2)
    for state in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            state[key].mul_(r + 3)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(opt, root_rank=0)
everyone = hvd.allgather_object(([p.detach() for p in model.parameters()],
                                 [[s[k] for k in ("exp_avg", "exp_avg_sq")] for s in opt.state.values()]))
params0, state0 = everyone[0]
assert any(p.is_complex() for p in params0) and any(s[0].is_complex() for s in state0), [p.dtype for p in params0]
assert all(torch.equal(a, b) for theirs, _ in everyone for a, b in zip(theirs, params0)), "parameters differ"
assert all(torch.equal(a, b) for _, theirs in everyone for sa, sb in zip(theirs, state0) for a, b in zip(sa, sb)), \
    "optimizer state differs"
checks += 1

# ---- DDP on the aiacc backend equals DDP on gloo in the same job ----------------------------------
dist.init_process_group("aiacc")
gloo = dist.new_group(backend="gloo")
mine = of(r, (5,), torch.complex64, 30)
total = torch.stack([of(k, (5,), torch.complex64, 30) for k in range(n)]).sum(0)
for group in (None, gloo):  # the collectives themselves
    t = mine.clone()
    dist.all_reduce(t, group=group)
    close(f"dist.all_reduce {group}", t, total, 1e-6)
    gathered = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(gathered, mine, group=group)
    close(f"dist.all_gather {group}", torch.stack(gathered), torch.stack([of(k, (5,), torch.complex64, 30)
                                                                          for k in range(n)]), 0)
results = []
for group in (None, gloo):  # None: the default group, on the aiacc backend
    model = Mixed(torch.float32)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    rows = slice(r * BATCH // n, (r + 1) * BATCH // n)
    for x, y in batches(torch.float32, STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x[rows]), y[rows]).backward()
        opt.step()
    results.append([p.detach().clone() for p in model.parameters()])
want = [p.detach() for p in train("sgd", torch.float32, 1, False, "ddp")[0].parameters()]
err = worst_relative(results[0], results[1])
assert err <= 2e-6, f"DDP on aiacc differs from DDP on gloo by {err:.3g} (relative)"
assert worst_relative(results[0], want) <= 2e-5, worst_relative(results[0], want)
checks += 2
dist.destroy_process_group()

say(f"OK rank={r} checks={checks}")
hvd.shutdown()
sys.exit(0)
