"""DistributedOptimizer when the model's parameters change around it: converted after wrapping (Module._apply
sets ``.data`` of each gradient, which had left the bucket views holding their own memory: each rank's own
gradient, silently), a parameter put in place of another (averaged from the step that sees it), a parameter listed
twice, a second wrapper of the same parameters, bucket_cap_mb given per rank. Each either equals one process on the whole batch (every rank
computes the reference) or is refused naming the parameter, on every rank alike."""

import warnings

import torch

import aiacc.torch as hvd
from report import say

hvd.init()
torch.set_num_threads(1)
warnings.filterwarnings("ignore", message="optimizer contains a parameter group with duplicate parameters")
r, n = hvd.rank(), hvd.size()
checks = 0
g = torch.Generator().manual_seed(1)
X = torch.randn(2 * n, 2, 5, 5, generator=g)
mine = slice(2 * r, 2 * r + 2)


def made():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.Tanh(), torch.nn.Flatten(), torch.nn.Linear(27, 2))


def same(what, model, ref, tol=1e-6):
    global checks
    worst = max(float((p.double() - q.double()).detach().abs().max()) for p, q in zip(model.parameters(),
                                                                                        ref.parameters()))
    assert worst <= tol, f"rank {r}: {what}: {worst:.3g} from the one-process reference"
    checks += 1


def train(make_opt, convert=None, at=None, steps=4, set_to_none=True, names=True, unset=False, overlap=False):
    """(model, reference) after ``steps`` steps; ``convert(module)`` applied to both before step ``at`` (after
    ``model.zero_grad()``, which sets every gradient to None, with ``unset``). ``overlap``: overlap_forward, whose
    buckets are still being averaged when ``convert`` runs."""
    model, ref = made(), made()
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()), overlap_forward=overlap,
                                   named_parameters=model.named_parameters() if names else None)
    ref_opt = make_opt(ref.parameters())
    for step in range(steps):
        if step == at:
            if unset:
                model.zero_grad()
            convert(model)
            convert(ref)
        x = X.to(next(model.parameters()).dtype)
        for m, o, batch in ((model, opt, x[mine]), (ref, ref_opt, x)):
            o.zero_grad(set_to_none=set_to_none)
            m(batch.contiguous(memory_format=torch.channels_last)).square().mean().backward()
            o.step()
    opt.remove_hooks()
    return model, ref


def plain_steps(model, opt, ref, ref_opt, steps=3):
    """``steps`` steps of ``model`` on this rank's part of the batch and of ``ref`` on the whole of it."""
    for _ in range(steps):
        for m, o, batch in ((model, opt, X[mine]), (ref, ref_opt, X)):
            o.zero_grad()
            m(batch).square().mean().backward()
            o.step()


def channels_last(m):
    m.to(memory_format=torch.channels_last)


# converted to channels_last after the buckets were settled (step 2), or before the first step: equal, the
# gradients laid out as their parameters (torch's fused kernels read them so)
for make in (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), lambda ps: torch.optim.Adam(ps, lr=0.05, fused=True)):
    for at, set_to_none, unset in ((2, True, False), (2, False, False), (0, True, False), (2, True, True)):
        model, ref = train(make, channels_last, at, set_to_none=set_to_none, unset=unset)
        same(f"channels_last before step {at}, set_to_none={set_to_none}, gradients None first: {unset}", model, ref)
        w = model[0].weight
        assert w.grad.stride() == w.stride(), (w.grad.stride(), w.stride())

# overlap_forward: converted between step() and the next forward, while the buckets are being averaged (the
# conversion copies each gradient's memory then): the averaged gradient is used all the same (SGD: torch's fused
# Adam would read the reference's state, made before the conversion, with the old layout)
model, ref = train(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), channels_last, 2, overlap=True)
same("overlap_forward, channels_last between step() and forward", model, ref)

# converted to another dtype: its bucket holds float32 gradients; refused, naming the parameter
for at, unset in ((2, False), (0, False), (2, True)):
    try:
        train(lambda ps: torch.optim.SGD(ps, lr=0.1), lambda m: m.double(), at, unset=unset)
        raise AssertionError(f"model.double() before step {at} (gradients None first: {unset}) was not refused")
    except RuntimeError as e:
        assert "is now torch.float64" in str(e) and "was torch.float32" in str(e), e
    checks += 1

# a parameter put in place of another in the optimizer's group (the same number of parameters): its gradient has no
# hook; refused at step() before, now the step that sees it averages it and the buckets are laid out again
model, ref = made(), made()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
for step in range(3):
    for m, o, batch in ((model, opt, X[mine]), (ref, ref_opt, X)):
        if step == 1:
            m[3].weight = torch.nn.Parameter(m[3].weight.detach().clone())
            o.param_groups[0]["params"][2] = m[3].weight
        o.zero_grad()
        m(batch).square().mean().backward()
        o.step()
same("a parameter put in place of another", model, ref)
opt.remove_hooks()

# a parameter listed twice in a param group (torch warns), no named_parameters: averaged once, as with names
model, ref = made(), made()
ps, ref_ps = list(model.parameters()), list(ref.parameters())
opt = hvd.DistributedOptimizer(torch.optim.SGD([{"params": ps + ps[:1]}], lr=0.1))
ref_opt = torch.optim.SGD([{"params": ref_ps + ref_ps[:1]}], lr=0.1)
plain_steps(model, opt, ref, ref_opt)
same("a parameter listed twice", model, ref)
opt.remove_hooks()

# a second wrapper made while the first is alive (``opt = hvd.DistributedOptimizer(...)`` again): the newer one
# takes the parameters over (a backward pass hands their gradients to it alone) and trains equal to one process;
# the older one, stepped again, is refused naming a parameter (each points p.grad into its own buckets)
model, ref = made(), made()
first = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
second = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
plain_steps(model, second, ref, ref_opt)
same("the newer of two live wrappers", model, ref)
for misuse in (first.step, first.zero_grad):
    try:
        misuse()
        raise AssertionError(f"{misuse.__name__}() of the older wrapper was not refused")
    except RuntimeError as e:
        assert "parameter '0.weight' is averaged by a DistributedOptimizer made after this one" in str(e), e
    checks += 1

# bucket_cap_mb given differently per rank (tiny on rank 0: a bucket per parameter; the default elsewhere): rank
# 0's applies on every rank (each rank had laid its buckets out its own way: differently named, a hang)
model, ref = made(), made()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                               bucket_cap_mb=1e-5 if r == 0 else 25)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
plain_steps(model, opt, ref, ref_opt)
same("bucket_cap_mb given differently per rank", model, ref)
assert len(opt._aiacc_buckets.buckets) >= 3, opt._aiacc_buckets.describe()  # (25 MiB: one bucket)
opt.remove_hooks()

say(f"OK rank={r} checks={checks}")
