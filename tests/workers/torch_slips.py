"""Slips of a Horovod-style PyTorch script that trained on without a word or failed far from the cause, each now an
error on every rank that names what to do, and the job goes on:

- stepping the optimizer that ``hvd.DistributedOptimizer`` wrapped (the wrapper kept under another name, or not kept:
  ``hvd.DistributedOptimizer(opt, ...)`` without ``opt =``): each rank trained on its own gradients, the ranks apart,
  exit 0; a scheduler made on the wrapped optimizer afterwards still works (it wraps the refusing ``step``);
- ``with opt.skip_synchronize(): opt.step()`` without ``opt.synchronize()`` first: gradients read while the engine
  averaged them (a mix by timing), and the same-start check then blamed a missing broadcast; and ``synchronize()``
  after ``step()`` made the next ``step()`` warn that its gradients were averaged again (they were not);
- ``broadcast_optimizer_state`` of an SGD on one rank and an Adam on the other: the root's settings loaded into the
  other class, a ``KeyError: 'betas'`` from torch at the next step;
- ``SyncBatchNorm`` layers of other widths on the ranks: the error named an internal allgather only;
- a nested tensor: "has dtype float32, which aiacc does not support; supported: ..., float32, ...".
"""

import gc
import warnings

import torch

import aiacc
import aiacc.torch as hvd
from report import raises, say

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
checks = 0


def seen(case: str, text: str) -> None:
    global checks
    checks += 1
    say(f"ERROR-SEEN rank={r} {case}: {text}")


def data(k: int, step: int):
    g = torch.Generator().manual_seed(100 * k + step)
    return torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randn(5, 2, generator=g, dtype=torch.float64)


def fresh(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 2).double()


def loss_of(model, k: int, step: int) -> torch.Tensor:
    x, y = data(k, step)
    return torch.nn.functional.mse_loss(model(x), y)


def reference(steps: int) -> torch.nn.Linear:
    """One process on every rank's batch: the mean of the ranks' losses, plain SGD."""
    ref = fresh()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        (sum(loss_of(ref, k, step) for k in range(n)) / n).backward()
        opt.step()
    return ref


def same_as(model, want, what: str) -> None:
    global checks
    for (name, p), q in zip(model.named_parameters(), want.parameters()):
        assert torch.allclose(p.detach(), q.detach(), rtol=1e-12, atol=1e-12), \
            f"{what}: {name} differs from one process by {(p - q).abs().max().item()}"
        checks += 1


# 1. the wrapper kept under another name, the wrapped optimizer stepped
model = fresh()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
dist = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
before = [p.detach().clone() for p in model.parameters()]
opt.zero_grad()
loss_of(model, r, 0).backward()
seen("kept", raises(RuntimeError, opt.step, "step() was called on the SGD that hvd.DistributedOptimizer wrapped",
                    "call step() on the optimizer hvd.DistributedOptimizer returned"))
assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)), "a refused step changed the parameters"
# ... and the script goes on with the wrapper; a scheduler made on the wrapped optimizer now wraps its step as
# torch's own (lr_scheduler takes step.__func__: an AttributeError for a plain function), and sets the learning rate
# both optimizers share (it warns that the wrapped one never stepped, as before)
scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=1.0)
dist.step()  # (the gradients of the backward above)
for step in range(1, 3):
    dist.zero_grad()
    loss_of(model, r, step).backward()
    dist.step()
    scheduler.step()
same_as(model, reference(3), "the wrapper stepped after the refused step")

# 2. the wrapper not kept: hvd.DistributedOptimizer(opt, ...) without `opt =`
model = fresh()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
gc.collect()
opt.zero_grad()
loss_of(model, r, 0).backward()
seen("not kept", raises(RuntimeError, opt.step, "the one made from this optimizer was not kept",
                        "write opt = hvd.DistributedOptimizer(opt, ...)"))

# 3. skip_synchronize() without synchronize(): refused before the update; with synchronize() first, as Horovod's
# docs show, it trains as one process
model = fresh()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
before = [p.detach().clone() for p in model.parameters()]
opt.zero_grad()
loss_of(model, r, 0).backward()
with opt.skip_synchronize():
    seen("skip", raises(RuntimeError, opt.step, "optimizer.step() was called inside optimizer.skip_synchronize()",
                        "'weight', 'bias'", "call optimizer.synchronize() first"))
assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)), "a refused step changed the parameters"
for step in range(3):
    if step:
        opt.zero_grad()
        loss_of(model, r, step).backward()
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()
same_as(model, reference(3), "synchronize() then step() inside skip_synchronize()")

# ... and synchronize() after step() (before reading the parameters, as with overlap_forward) no longer makes the
# next step() warn that its gradients are "averaged again" (nothing was); synchronize() before step() outside
# skip_synchronize() still does, as Horovod's
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for step in range(3, 5):
        opt.zero_grad()
        loss_of(model, r, step).backward()
        opt.step()
        opt.synchronize()
    assert not [w for w in caught if "averaged again" in str(w.message)], [str(w.message) for w in caught]
    opt.zero_grad()
    loss_of(model, r, 5).backward()
    opt.synchronize()
    opt.step()
    assert [w for w in caught if "averaged again" in str(w.message)], [str(w.message) for w in caught]
checks += 1

# 4. broadcast_optimizer_state across optimizer classes
model = fresh()
kind = torch.optim.SGD if r == 0 else torch.optim.Adam
opt = hvd.DistributedOptimizer(kind(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
keys = set(opt.param_groups[0])
seen("classes", raises(ValueError, lambda: hvd.broadcast_optimizer_state(opt, root_rank=0),
                       "the optimizers differ across ranks", "rank 0: SGD [2]", "rank 1: Adam [2]"))
assert set(opt.param_groups[0]) == keys, "the refused broadcast changed the optimizer's settings"

# 5. SyncBatchNorm of other widths
bn = hvd.SyncBatchNorm(3 + r).double()
seen("syncbn", raises(hvd.TensorMismatchError, lambda: bn(torch.ones(4, 3 + r, dtype=torch.float64)),
                      f"SyncBatchNorm: this rank's layer has {3 + r} channels",
                      "Every rank must run the same SyncBatchNorm layers", "'SyncBatchNorm.forward."))
# and of other dtypes (it said the channels differed): named as dtypes
bn = hvd.SyncBatchNorm(3)
bn = bn.double() if r else bn
seen("syncbn dtype", raises(hvd.TensorMismatchError,
                            lambda: bn(torch.ones(4, 3, dtype=torch.float64 if r else torch.float32)),
                            "SyncBatchNorm: the ranks' inputs differ in dtype", "dtype differs across ranks"))

# 6. a nested tensor
nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
seen("nested", raises(ValueError, lambda: hvd.allreduce(nested, name="nest"),
                      "tensor 'nest' is a nested tensor; aiacc communicates dense tensors"))

# the job goes on: the engine still works on every rank
total = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, name="after")
assert total.item() == sum(range(n)), total
checks += 1
say(f"OK rank={r} checks={checks}")
aiacc.shutdown()
