"""aiacc.torch on a real job: every collective, autograd through them, the start-of-training
broadcasts, and misuse errors. References are computed on each rank with plain torch from
what every rank contributed (inputs are deterministic functions of the rank).
"""

import sys
import warnings

import torch

import aiacc
import aiacc.torch as hvd
from report import raises, say

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
checks = 0


def close(name, got, want, tol=1e-12):
    global checks
    assert isinstance(got, torch.Tensor), f"{name}: got {type(got).__name__}"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if tol == 0:
        assert torch.equal(got, want), f"{name}: {got.flatten()[:6]} != {want.flatten()[:6]}"
    else:
        assert torch.allclose(got.double(), want.double(), rtol=tol, atol=tol), \
            f"{name}: max err {(got.double() - want.double()).abs().max()}"
    checks += 1


def expect(exc_type, fn, *words):
    global checks
    say(f"ERROR-SEEN rank={r}: {raises(exc_type, fn, *words)}")
    checks += 1


def of(k, shape=(3, 4), dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + k)
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    return torch.randint(1, 5, shape, generator=g).to(dtype)


# ---- allreduce in every form ------------------------------------------------------------------
for seed, dtype in enumerate([torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64]):
    xs = [of(k, dtype=dtype, seed=seed) for k in range(n)]
    wide = torch.stack([x.double() for x in xs])
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-6}.get(dtype, 1e-12 if dtype.is_floating_point else 0)
    name = str(dtype).split(".")[1]
    mine = xs[r].clone()
    for op, ref in ((hvd.Sum, wide.sum(0)), (hvd.Min, wide.min(0).values), (hvd.Max, wide.max(0).values),
                    (hvd.Product, wide.prod(0))):
        close(f"allreduce {op} {name}", hvd.allreduce(mine, op=op, name=f"ar.{op}.{name}"), ref.to(dtype), tol)
    avg = wide.sum(0) / n if dtype.is_floating_point else torch.div(wide.sum(0), n, rounding_mode="floor")
    close(f"allreduce avg {name}", hvd.allreduce(mine, name=f"ar.avg.{name}"), avg.to(dtype), tol)
    assert torch.equal(mine, xs[r]), "allreduce modified its input"
    if dtype.is_floating_point:
        close(f"allreduce scaled {name}", hvd.allreduce(mine, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0,
                                                        name=f"ar.scaled.{name}"), (wide.sum(0) * 1.5).to(dtype), tol)
    # in place: the same tensor object and memory, now holding the sum
    ptr = mine.data_ptr()
    out = hvd.allreduce_(mine, op=hvd.Sum, name=f"ar_.{name}")
    assert out is mine and mine.data_ptr() == ptr
    close(f"allreduce_ {name}", mine, wide.sum(0).to(dtype), tol)

x = of(r)
h = hvd.allreduce_async(x, op=hvd.Sum, name="async")
close("allreduce_async", hvd.synchronize(h), sum(of(k) for k in range(n)))
assert hvd.poll(h)
raises(TypeError, lambda: hvd.synchronize(7), "synchronize() takes the handle an *_async call returned, not int 7")
raises(TypeError, lambda: hvd.poll("h"), "poll() takes the handle an *_async call returned, not str 'h'")
checks += 1
# one tensor given to a grouped call was taken as the list of its rows (each row reduced alone, no error)
for call in (hvd.grouped_allreduce, hvd.grouped_allreduce_, hvd.grouped_allreduce_async, hvd.grouped_allgather,
             hvd.grouped_allgather_async, hvd.grouped_reducescatter, hvd.grouped_reducescatter_async):
    raises(TypeError, lambda: call(torch.ones(3, 2), name="one"), " of 'one' takes a list of tensors, not one tensor "
           "(shape (3, 2))", "(tensor), or pass [tensor]")
checks += 1
y = x.clone()
h = hvd.allreduce_async_(y, name="async_")
assert hvd.synchronize(h) is y
close("allreduce_async_", y, sum(of(k) for k in range(n)) / n)
close("allreduce average=False", hvd.allreduce(x, average=False, name="deprecated"), sum(of(k) for k in range(n)))
# a non-contiguous tensor in place (staged, then copied back)
t = of(r, (4, 3)).t()
hvd.allreduce_(t, op=hvd.Sum, name="transposed")
close("allreduce_ non-contiguous", t, sum(of(k, (4, 3)) for k in range(n)).t())
# fp16 on the wire: a float32 result within float16's precision
close("fp16 compression", hvd.allreduce(of(r, dtype=torch.float32), name="fp16", compression=hvd.Compression.fp16),
      (sum(of(k) for k in range(n)) / n).float(), 2e-3)
close("bf16 compression", hvd.allreduce(of(r, dtype=torch.float32), name="bf16", compression=hvd.Compression.bf16),
      (sum(of(k) for k in range(n)) / n).float(), 2e-2)

# grouped
group = [of(r, (2,)), of(r, (3, 3), torch.int64, seed=4)]
out = hvd.grouped_allreduce(group, op=hvd.Sum, name="group")
close("grouped 0", out[0], sum(of(k, (2,)) for k in range(n)))
close("grouped 1", out[1], sum(of(k, (3, 3), torch.int64, seed=4) for k in range(n)), 0)
out = hvd.synchronize(hvd.grouped_allreduce_async(group, name="group.async"))
close("grouped async", out[0], sum(of(k, (2,)) for k in range(n)) / n)
same = hvd.grouped_allreduce_(group, op=hvd.Max, name="group_")
assert same[0] is group[0]
close("grouped_", group[0], torch.stack([of(k, (2,)) for k in range(n)]).max(0).values)
# one name, step after step (its numpy views remembered): the same tensors, a tensor replaced, new memory under one
total = lambda shape, seed: sum(of(k, shape, seed=seed) for k in range(n))  # noqa: E731
g = [of(r, (2,)), of(r, (4,), seed=5)]
hvd.grouped_allreduce_(g, op=hvd.Sum, name="group.steps")
close("grouped_ steps 1", torch.cat(g), torch.cat([total((2,), 0), total((4,), 5)]))
old, g[1] = g[1], of(r, (4,), seed=6)
hvd.grouped_allreduce_(g, op=hvd.Sum, name="group.steps")
close("grouped_ steps 2", torch.cat(g + [old]), torch.cat([n * total((2,), 0), total((4,), 6), total((4,), 5)]))
g[0].data = of(r, (2,), seed=7)
hvd.grouped_allreduce_(g, op=hvd.Sum, name="group.steps")
close("grouped_ steps 3", torch.cat(g), torch.cat([total((2,), 7), n * total((4,), 6)]))

# ---- allgather, broadcast, alltoall, reducescatter ----------------------------------------------
parts = [of(k, (k + 1, 2), torch.float32, seed=7) for k in range(n)]
close("allgather", hvd.allgather(parts[r], name="ag"), torch.cat(parts), 0)
close("allgather_async", hvd.synchronize(hvd.allgather_async(parts[r], name="ag.async")), torch.cat(parts), 0)
close("allgather bf16", hvd.allgather(parts[r].bfloat16(), name="ag.bf16"), torch.cat(parts).bfloat16(), 0)
for root in range(n):
    close(f"broadcast {root}", hvd.broadcast(of(r), root, name=f"bc.{root}"), of(root), 0)
b = of(r)
assert hvd.broadcast_(b, n - 1, name="bc_") is b
close("broadcast_", b, of(n - 1), 0)
b = of(r)
hvd.synchronize(hvd.broadcast_async_(b, 0, name="bc.async_"))
close("broadcast_async_", b, of(0), 0)
close("broadcast_async", hvd.synchronize(hvd.broadcast_async(of(r), 0, name="bc.async")), of(0), 0)
rows = [torch.arange(2 * n, dtype=torch.float32) + 100 * k for k in range(n)]
close("alltoall", hvd.alltoall(rows[r], name="a2a"), torch.cat([rows[k][2 * r:2 * r + 2] for k in range(n)]), 0)
splits = [1 + (r + j) % 2 for j in range(n)]
got, received = hvd.alltoall(torch.arange(sum(splits), dtype=torch.float64) + 100 * r,
                             splits=torch.tensor(splits, dtype=torch.int32), name="a2av")
assert received.tolist() == [1 + (k + r) % 2 for k in range(n)], received
assert got.shape[0] == sum(received.tolist())
checks += 1
rs_in = [of(k, (2 * n, 2), seed=9) for k in range(n)]
close("reducescatter", hvd.reducescatter(rs_in[r], op=hvd.Sum, name="rs"), sum(rs_in)[2 * r:2 * r + 2])
close("reducescatter fp16", hvd.reducescatter(rs_in[r].float(), name="rs.fp16", compression=hvd.Compression.fp16),
      (sum(rs_in) / n)[2 * r:2 * r + 2].float(), 2e-3)
# the _async forms in Horovod's argument order (tensor, name, op, process_set, prescale, postscale): before, the
# third went to compression and the job raised
close("reducescatter_async(t, name, op, set, prescale)", hvd.synchronize(hvd.reducescatter_async(
    rs_in[r], "rs.async", hvd.Sum, None, 2.0)), 2 * sum(rs_in)[2 * r:2 * r + 2])
close("grouped_reducescatter_async(ts, name, op)", hvd.synchronize(hvd.grouped_reducescatter_async(
    [rs_in[r]], "rs.grouped.async", hvd.Sum))[0], sum(rs_in)[2 * r:2 * r + 2])

# ---- autograd through the collectives, against single-process torch -----------------------------
w = [of(k, seed=11) for k in range(n)]  # rank k's loss is (y * w[k]).sum()
# allreduce (Average): the gradient is the average of the ranks' output gradients
x = of(r, seed=12).requires_grad_()
(hvd.allreduce(x, name="ag.grad.ar") * w[r]).sum().backward()
leaves = [of(k, seed=12).requires_grad_() for k in range(n)]
ymean = torch.stack(leaves).mean(0)
sum((ymean * w[k]).sum() for k in range(n)).backward()
close("d allreduce", x.grad, leaves[r].grad)
x = of(r, seed=12).requires_grad_()
(hvd.allreduce(x, op=hvd.Sum) * w[r]).sum().backward()  # unnamed: matched by call order, also in backward
close("d allreduce Sum", x.grad, sum(w))
# Max, Min, Product: the ranks' output gradients summed, times the op's derivative for this rank's input (an element
# tied across ranks split evenly, as torch.amax does); it was Max (Min, Product) of the output gradients
for op, reduce in ((hvd.Max, lambda t: t.amax(0)), (hvd.Min, lambda t: t.amin(0)), (hvd.Product, lambda t: t.prod(0))):
    base = [of(k, seed=18) for k in range(n)]
    for b in base:
        b[0] = 0.5  # the same on every rank
    leaves = [b.clone().requires_grad_() for b in base]
    sum((reduce(torch.stack(leaves)) * w[k]).sum() for k in range(n)).backward()
    x = base[r].clone().requires_grad_()
    (hvd.allreduce(x, op=op, name=f"grad.{op.name}") * w[r]).sum().backward()
    close(f"d allreduce {op.name}", x.grad, leaves[r].grad)
    # grouped, two tensors (their gradients' inputs gathered in one grouped allgather for Product)
    leaves2 = [(b * 2).requires_grad_() for b in base]
    leaves = [b.clone().requires_grad_() for b in base]
    sum(((reduce(torch.stack(leaves)) + reduce(torch.stack(leaves2))) * w[k]).sum() for k in range(n)).backward()
    x, x2 = base[r].clone().requires_grad_(), (base[r] * 2).requires_grad_()
    ys = hvd.grouped_allreduce([x, x2], op=op, name=f"grad.group.{op.name}")
    ((ys[0] + ys[1]) * w[r]).sum().backward()
    close(f"d grouped allreduce {op.name}", torch.cat([x.grad, x2.grad]),
          torch.cat([leaves[r].grad, leaves2[r].grad]))
# allgather: this rank's rows of the averaged output gradient (the gradient of the ranks' mean loss)
sizes = [k + 1 for k in range(n)]
W = [of(k, (sum(sizes), 3), seed=13) for k in range(n)]
x = of(r, (sizes[r], 3), seed=14).requires_grad_()
(hvd.allgather(x, name="grad.ag") * W[r]).sum().backward()
leaves = [of(k, (sizes[k], 3), seed=14).requires_grad_() for k in range(n)]
Y = torch.cat(leaves)
(sum((Y * W[k]).sum() for k in range(n)) / n).backward()
close("d allgather", x.grad, leaves[r].grad)
# a scalar that requires grad: the same error as without (it was a bare IndexError)
raises(ValueError, lambda: hvd.allgather(torch.tensor(1.0, requires_grad=True), name="s0"),
       "allgather of tensor 's0' needs at least one dimension (got a scalar)")
checks += 1
# broadcast: the averaged output gradient on the root, zeros elsewhere
x = of(r, seed=15).requires_grad_()
(hvd.broadcast(x, 1 % n, name="grad.bc") * w[r]).sum().backward()
leaves = [of(k, seed=15).requires_grad_() for k in range(n)]
(sum((leaves[1 % n] * w[k]).sum() for k in range(n)) / n).backward()
close("d broadcast", x.grad, leaves[r].grad if leaves[r].grad is not None else torch.zeros_like(x))
# grouped allreduce and alltoall
a, c = of(r, (2,), seed=16).requires_grad_(), of(r, (3,), seed=17).requires_grad_()
ga, gc = hvd.grouped_allreduce([a, c], op=hvd.Sum, name="grad.group")
(ga * (r + 1)).sum().add((gc * gc).sum()).backward()
close("d grouped 0", a.grad, torch.full((2,), n * (n + 1) / 2, dtype=torch.float64))
close("d grouped 1", c.grad, 2 * n * sum(of(k, (3,), seed=17) for k in range(n)))
x = (torch.arange(2 * n, dtype=torch.float64) + 10 * r).requires_grad_()
(hvd.alltoall(x, name="grad.a2a") * (r + 1)).sum().backward()
close("d alltoall", x.grad, torch.tensor([k + 1.0 for k in range(n) for _ in range(2)], dtype=torch.float64))


# ---- broadcast_parameters / broadcast_optimizer_state ------------------------------------------
def net(seed, hidden=6):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 3),
                               torch.nn.BatchNorm1d(3)).double()


def local_steps(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.rand(8, 4, generator=g, dtype=torch.float64)).pow(2).mean().backward()
        opt.step()


def flat(model):  # parameters and buffers
    return torch.cat([t.detach().reshape(-1).double() for t in model.state_dict().values()])


def flat_params(model):  # batch-norm statistics stay per rank, as in Horovod
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def equal_across_ranks(what, tensor):
    global checks
    everyone = hvd.allgather_object(tensor)
    for k, other in enumerate(everyone):
        assert torch.equal(other, everyone[0]), f"{what}: rank {k} differs from rank 0 by {(other - everyone[0]).abs().max()}"
    checks += 1


for root, fresh_ranks in ((0, ()), (n - 1, (0,))):
    model = net(100 + r)  # different weights on every rank
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1), betas=(0.8, 0.9))
    if r not in fresh_ranks:
        local_steps(model, opt, 2 + r, seed=r)  # different moments and step counts
    hvd.broadcast_parameters(model.state_dict(), root_rank=root)
    hvd.broadcast_optimizer_state(opt, root, model)  # Horovod's (optimizer, root_rank, model=None)
    assert opt.param_groups[0]["lr"] == 0.01 * (root + 1) and opt.param_groups[0]["betas"] == (0.8, 0.9)
    equal_across_ranks("parameters after broadcast", flat(model))
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    local_steps(model, opt, 3, seed=50 + r)  # different data, averaged gradients, same state
    equal_across_ranks(f"parameters after training (root {root})", flat_params(model))
    equal_across_ranks("Adam moments", torch.cat([s["exp_avg_sq"].reshape(-1) for s in opt.state.values()]))
    opt.remove_hooks()
raises(ValueError, lambda: hvd.broadcast_optimizer_state(opt, 0, "Parameter."), "model= expects a torch.nn.Module, not str")
checks += 1
# a dtype aiacc does not carry is refused before anything is sent: the same call without it then works
buffers = {"a": torch.full((2,), float(r)), "c": torch.zeros(2, dtype=torch.complex32), "d": torch.full((3,), float(r))}
raises(TypeError, lambda: hvd.broadcast_parameters(buffers, 1), "'Parameter.c' has dtype complex32")
del buffers["c"]
hvd.broadcast_parameters(buffers, 1)
assert all(torch.equal(t, torch.full_like(t, 1.0)) for t in buffers.values()), buffers
checks += 1

# named_parameters (generator) form, and the optimizer object keeps its class and state
model = net(200 + r)
hvd.broadcast_parameters(model.named_parameters(), root_rank=0)
equal_across_ranks("named_parameters broadcast", torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
assert isinstance(opt, torch.optim.SGD) and opt is not base and opt.state is base.state
assert opt.param_groups is base.param_groups  # schedulers on either object change both
hvd.broadcast_optimizer_state(opt, root_rank=0)  # load_state_dict on the other ranks
# the first step settles the buckets: from then on every p.grad is a view of its bucket's memory
model(of(r, (8, 4))).sum().backward()
opt.step()
opt.zero_grad()
assert all(p.grad is not None and not p.grad.any() for p in model.parameters())  # zeroed in place, not None
calls = []
opt.register_step_post_hook(lambda *_: calls.append(1))
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
model(of(r, (8, 4))).sum().backward()
grads = {name: p.grad for name, p in model.named_parameters()}
ptrs = {name: g.data_ptr() for name, g in grads.items()}
opt.step()
sched.step()
assert opt.param_groups[0]["lr"] == 0.05
assert calls == [1], f"step hooks ran {len(calls)} times"
for name, p in model.named_parameters():  # averaged in their buckets: the same tensors, the same memory
    assert p.grad is grads[name] and p.grad.data_ptr() == ptrs[name], name
equal_across_ranks("gradients averaged in place", torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
# synchronize() + skip_synchronize(), as for gradient clipping
opt.zero_grad()
model(of(r, (8, 4))).sum().backward()
opt.synchronize()
torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
with opt.skip_synchronize():
    opt.step()
equal_across_ranks("clipped step", flat_params(model))

# Horovod's mixed-precision recipe: GradScaler + synchronize() + unscale_ + clip + skip_synchronize(), against
# plain torch on each rank with every rank's gradient averaged by hand; an overflow on one rank only (its
# gradient inf) skips the step on every rank and lowers every rank's scale
def amp_net():
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def amp_loss(m, k, step):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(of(k, (5, 4), torch.float32, seed=40 + step))
    loss = out.float().pow(2).mean()
    return loss * float("inf") if step == 2 and k == n - 1 else loss  # step 2: rank n-1 overflows


def amp_steps(tag, horovod_recipe):
    """4 steps of the GradScaler loop against the reference (every rank's gradients averaged by hand).
    ``horovod_recipe``: synchronize(); unscale_; clip; skip_synchronize() around scaler.step. Otherwise
    torch's own loop, as DDP users write it: scaler.step() unscales the gradients through
    optimizer.param_groups before it calls step(), which first waits for the averaged ones."""
    amp_model, amp_ref = amp_net(), amp_net()
    amp_opt = hvd.DistributedOptimizer(torch.optim.SGD(amp_model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=[(f"{tag}.{k}", p) for k, p in amp_model.named_parameters()])
    ref_opt = torch.optim.SGD(amp_ref.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    for step in range(4):
        amp_opt.zero_grad()
        scaler.scale(amp_loss(amp_model, r, step)).backward()
        if horovod_recipe:
            amp_opt.synchronize()
            scaler.unscale_(amp_opt)
            torch.nn.utils.clip_grad_norm_(amp_model.parameters(), 0.5)
            with amp_opt.skip_synchronize():
                scaler.step(amp_opt)
        else:
            scaler.step(amp_opt)
        scaler.update()
        every = []
        for k in range(n):
            ref_opt.zero_grad()
            ref_scaler.scale(amp_loss(amp_ref, k, step)).backward()
            every.append([p.grad.clone() for p in amp_ref.parameters()])
        for p, *grads in zip(amp_ref.parameters(), *every):
            p.grad = sum(grads) / n
        if horovod_recipe:
            ref_scaler.unscale_(ref_opt)
            torch.nn.utils.clip_grad_norm_(amp_ref.parameters(), 0.5)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        assert scaler.get_scale() == ref_scaler.get_scale() == 2.0 ** (12 - (step >= 2)), (step, scaler.get_scale())
        for p, q in zip(amp_model.parameters(), amp_ref.parameters()):
            close(f"{tag} step {step}", p.detach(), q.detach(), tol=1e-6)
    equal_across_ranks(f"{tag} steps", torch.cat([p.detach().reshape(-1) for p in amp_model.parameters()]))
    amp_opt.remove_hooks()


amp_steps("amp", horovod_recipe=True)
amp_steps("amp2", horovod_recipe=False)  # the overflow on one rank: every rank skips that step

# a scheduler made on the torch optimizer before wrapping it keeps scheduling after broadcast_optimizer_state
# (which loads the root's state on the other ranks) and after load_state_dict (a checkpoint): the wrapper
# loads into the groups the scheduler holds
sched_model = net(310)
sched_opt = torch.optim.SGD(sched_model.parameters(), lr=0.1, momentum=0.5)
sched = torch.optim.lr_scheduler.StepLR(sched_opt, step_size=1, gamma=0.5)
sched_opt = hvd.DistributedOptimizer(sched_opt, named_parameters=[(f"sched.{k}", p) for k, p in sched_model.named_parameters()])
hvd.broadcast_optimizer_state(sched_opt, root_rank=0)
strict = warnings.catch_warnings()  # torch's "lr_scheduler.step() before optimizer.step()" warned here
strict.__enter__()
warnings.simplefilter("error", UserWarning)
for epoch in range(3):
    sched_opt.zero_grad()
    sched_model(of(r, (5, 4), seed=50 + epoch)).sum().backward()
    sched_opt.step()
    sched.step()
    close(f"scheduled lr, epoch {epoch}", torch.tensor(sched_opt.param_groups[0]["lr"]), torch.tensor(0.1 * 0.5 ** (epoch + 1)))
sched_opt.load_state_dict(sched_opt.state_dict())
sched.step()
close("scheduled lr after load_state_dict", torch.tensor(sched_opt.param_groups[0]["lr"]), torch.tensor(0.1 * 0.5 ** 4))
strict.__exit__(None, None, None)
equal_across_ranks("scheduled steps", flat_params(sched_model))
sched_opt.remove_hooks()

# groups= / num_groups= are checked as Horovod checks them
w_g = torch.nn.Parameter(torch.ones(2))
for bad, words in (({"groups": -3}, "groups=-3"), ({"groups": 0}, "groups=0; expected a number of groups >= 1"),
                   ({"groups": "abc"}, "groups='abc'"), ({"num_groups": -1}, "num_groups=-1"),
                   ({"groups": [[1, 2]]}, "groups[0] holds a int"), ({"groups": [[w_g, w_g]]}, "appears twice in groups")):
    expect(ValueError, lambda: hvd.DistributedOptimizer(torch.optim.SGD([w_g], lr=0.1), **bad), words)
hvd.DistributedOptimizer(torch.optim.SGD([w_g], lr=0.1), groups=[[w_g]]).remove_hooks()


# step(closure): the gradients the closure's backward() produces are averaged before the update
def wrapped(m, tag):
    return hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                    named_parameters=[(f"{tag}.{k}", p) for k, p in m.named_parameters()])


m_a, m_b = net(300), net(300)
o_a, o_b = wrapped(m_a, "ca"), wrapped(m_b, "cb")
xb = of(r, (8, 4))


def closure():
    o_a.zero_grad()
    loss = m_a(xb).pow(2).mean()
    loss.backward()
    return loss


o_a.step(closure)
o_b.zero_grad()
m_b(xb).pow(2).mean().backward()
o_b.step()
close("step(closure)", flat_params(m_a), flat_params(m_b), 0)
# a replaced DistributedOptimizer stops sending: the same names again are not duplicates in flight
o_a = wrapped(m_a, "ca")
o_a.zero_grad()
m_a(xb).sum().backward()
o_a.step()
equal_across_ranks("after replacing the optimizer", flat_params(m_a))
o_a.remove_hooks()
o_b.remove_hooks()

def step_both_and_compare(what, o_p, o_ref, model, ref):
    """The reference's gradients (every rank's contributions, summed) averaged over the ranks, one step of
    each optimizer, and each parameter of ``model`` equal to the reference's."""
    for p in ref.parameters():
        if p.grad is not None:
            p.grad /= n
    o_p.step()
    o_ref.step()
    for (pname, p), q in zip(model.named_parameters(), ref.parameters()):
        close(f"{what}: {pname}", p.detach(), q.detach())


# ---- step() after fewer backward passes than backward_passes_per_step ---------------------------------
# what has accumulated so far is averaged and applied (Horovod's synchronize() reduces it as it is), in the
# first step (before the buckets are settled: its gradients were once dropped there, silently) as in later ones
torch.manual_seed(7)
lin = torch.nn.Linear(3, 2).double()
ref = torch.nn.Linear(3, 2).double()
ref.load_state_dict(lin.state_dict())
o_p = hvd.DistributedOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1), named_parameters=lin.named_parameters(),
                               backward_passes_per_step=3)
o_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
for step, passes in enumerate((1, 2, 1)):
    o_p.zero_grad()
    o_ref.zero_grad()
    for k in range(passes):
        lin(of(10 * step + k + 100 * r, (4, 3))).pow(2).sum().backward()
        for q in range(n):  # the reference sees every rank's passes: their sum, then averaged over ranks
            ref(of(10 * step + k + 100 * q, (4, 3))).pow(2).sum().backward()
    step_both_and_compare(f"step {step} after {passes} of 3 passes", o_p, o_ref, lin, ref)
o_p.remove_hooks()

# ---- gradients not made by this step's backward(), after the first step settled the buckets -------------
# (a) a head unused after step 0 with the module's zero_grad() (sets .grad to None): it counts as zeros, as in
# Horovod; (b) gradients set by hand from torch.autograd.grad. Both raised "the gradient of ... was replaced
# ... while it was being averaged" from the second step on, ending the job.
class _TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 2).double(), torch.nn.Linear(3, 2).double()

    def forward(self, x, use_b):
        return self.a(x).pow(2).sum() + (self.b(x).pow(2).sum() if use_b else 0)


for by_hand in (False, True):
    torch.manual_seed(8)
    two, ref = _TwoHeads(), _TwoHeads()
    ref.load_state_dict(two.state_dict())
    o_p = hvd.DistributedOptimizer(torch.optim.SGD(two.parameters(), lr=0.1), named_parameters=two.named_parameters())
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        use_b = by_hand or step == 0
        two.zero_grad()  # the module's: every .grad set to None
        o_ref.zero_grad()
        loss = two(of(20 * step + 100 * r, (4, 3)), use_b)
        if by_hand:
            for p, g in zip(two.parameters(), torch.autograd.grad(loss, list(two.parameters()))):
                p.grad = g
        else:
            loss.backward()
        for q in range(n):
            ref(of(20 * step + 100 * q, (4, 3)), use_b).backward()
        step_both_and_compare(f"{'autograd.grad' if by_hand else 'unused head'} step {step}", o_p, o_ref, two, ref)
    o_p.remove_hooks()

# ---- misuse ---------------------------------------------------------------------------------
# not a tensor (a .grad that is still None, say): a TypeError naming the tensor, on every path
for what, call in (("broadcast", lambda: hvd.broadcast(None, 0, name="no.grad")),
                   ("broadcast_", lambda: hvd.broadcast_(None, 0, name="no.grad")),
                   ("allreduce", lambda: hvd.allreduce(None, name="no.grad")),
                   ("allreduce_", lambda: hvd.allreduce_(None, name="no.grad")),
                   ("grouped_allreduce_", lambda: hvd.grouped_allreduce_([torch.ones(2), None], name="no.grad")),
                   ("allgather", lambda: hvd.allgather(None, name="no.grad"))):
    expect(TypeError, call, "tensor 'no.grad': expected a torch.Tensor, got NoneType")
# a sparse tensor where a dense one is taken: a ValueError naming the tensor and its layout, on every path
# (allreduce used to fail inside torch: "unsupported memory format option Contiguous")
sparse = torch.ones(2).to_sparse()
for what, call in (("allreduce", lambda: hvd.allreduce(sparse, name="emb.grad")),
                   ("allreduce_", lambda: hvd.allreduce_(sparse, name="emb.grad")),
                   ("allreduce_async_", lambda: hvd.synchronize(hvd.allreduce_async_(sparse, name="emb.grad"))),
                   ("grouped_allreduce", lambda: hvd.grouped_allreduce([torch.ones(2), sparse], name="emb.grad")),
                   ("broadcast", lambda: hvd.broadcast(sparse, 0, name="emb.grad")),
                   ("allgather", lambda: hvd.allgather(sparse, name="emb.grad"))):
    expect(ValueError, call, "tensor 'emb.grad' has layout torch.sparse_coo; aiacc communicates dense tensors",
           "use .to_dense()")
opt.zero_grad()
model(of(r, (8, 4))).sum().backward()
opt.zero_grad()  # between backward() and step(): thrown away once averaged (a GAN's loop does it), as in one process
assert all(p.grad is not None and not p.grad.any() for p in model.parameters()), "zero_grad() after backward()"
checks += 1
opt.step()
opt.zero_grad()
model(of(r, (8, 4))).sum().backward()
expect(RuntimeError, lambda: model(of(r, (8, 4))).sum().backward(),
       "the gradient of", "was computed more than backward_passes_per_step=1 times before step()")
opt.step()
opt.remove_hooks()
m2 = net(0)
p0, p1 = list(m2.parameters())[:2]
expect(ValueError, lambda: hvd.DistributedOptimizer(torch.optim.SGD([p0, p1], lr=0.1),
                                                    named_parameters=[("x", p0), ("x", p1)]),
       "duplicate parameter name 'x'")
expect(ValueError, lambda: hvd.DistributedOptimizer(torch.optim.SGD(m2.parameters(), lr=0.1),
                                                    named_parameters=list(m2.named_parameters())[:2]),
       "named_parameters does not cover parameters of the optimizer", "param_groups[0]['params'][2] (shape (3, 6))",
       "(4 parameters)")
# a model whose shapes differ across ranks: the error names the parameter and the ranks
odd = net(1, hidden=6 if r == 0 else 7)
OTHERS = ("rank " if n == 2 else "ranks ") + ",".join(str(k) for k in range(1, n))  # how the message names ranks 1..n-1
expect(hvd.TensorMismatchError, lambda: hvd.broadcast_parameters(odd.named_parameters(), root_rank=0),
       "tensor 'Parameter.0.weight': shape differs across ranks", "rank 0: (6, 4)", f"{OTHERS}: (7, 4)")
opt = hvd.DistributedOptimizer(torch.optim.SGD(odd.parameters(), lr=0.1), named_parameters=odd.named_parameters())
odd(of(r, (8, 4))).sum().backward()
expect(hvd.TensorMismatchError, opt.step, "tensor 'grad.0.weight': shape differs across ranks",
       "rank 0: (6, 4)", f"{OTHERS}: (7, 4)")
opt.remove_hooks()
# ranks whose optimizers differ in their parameters' names, or in how many there are (the first step's
# check used to be a collective named after the first name and the count: those ranks never met in it, a hang)
renamed = net(1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(renamed.parameters(), lr=0.1),
                               named_parameters=[(f"{'head' if r == 1 and k == '0.weight' else 'body'}.{k}", p)
                                                 for k, p in renamed.named_parameters()])
renamed(of(r, (8, 4))).sum().backward()
expect(hvd.TensorMismatchError, opt.step, "gradient 0 has different names across ranks", "rank 0: 'grad.body.0.weight'",
       "rank 1: 'grad.head.0.weight'")
opt.remove_hooks()
fewer = net(1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(list(fewer.parameters())[:3 if r == 1 else 4], lr=0.1),
                               named_parameters=list(fewer.named_parameters())[:3 if r == 1 else 4])
fewer(of(r, (8, 4))).sum().backward()
expect(hvd.TensorMismatchError, opt.step, "the number of gradients to average differs across ranks",
       "rank 0: 4", "rank 1: 3")
opt.remove_hooks()
expect(ValueError, lambda: hvd.allreduce(x, process_set=object()), "is not a registered process set")
# parameters with gradients that no hook hands over: frozen when the optimizer was wrapped and unfrozen since, or
# added with the torch optimizer's add_param_group. Their gradients stayed each rank's own and the ranks drifted
# apart without a word; then they were refused at step(); now the step that sees them averages them too and lays the
# buckets out again (torch_unfreeze.py).
torch.manual_seed(9)
two, ref = _TwoHeads(), _TwoHeads()
ref.load_state_dict(two.state_dict())
for m in (two, ref):
    m.b.weight.requires_grad_(False)
o_p = hvd.DistributedOptimizer(torch.optim.SGD(two.parameters(), lr=0.1),
                               named_parameters=[(f"unfrozen.{k}", p) for k, p in two.named_parameters()])
o_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
for step in range(2):  # frozen, it stays out and the others train as in one process
    o_p.zero_grad()
    o_ref.zero_grad()
    two(of(30 + step + 100 * r, (4, 3)), True).backward()
    for q in range(n):
        ref(of(30 + step + 100 * q, (4, 3)), True).backward()
    step_both_and_compare(f"a parameter frozen when wrapped, step {step}", o_p, o_ref, two, ref)
for m in (two, ref):
    m.b.weight.requires_grad_(True)
for step in range(2):  # unfrozen on every rank: averaged from the step that sees it on
    o_p.zero_grad()
    o_ref.zero_grad()
    two(of(40 + step + 100 * r, (4, 3)), True).backward()
    for q in range(n):
        ref(of(40 + step + 100 * q, (4, 3)), True).backward()
    step_both_and_compare(f"a parameter unfrozen, step {step}", o_p, o_ref, two, ref)
o_p.remove_hooks()
lin2, extra = torch.nn.Linear(3, 2).double(), torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
o_p = hvd.DistributedOptimizer(torch.optim.SGD(lin2.parameters(), lr=0.1),
                               named_parameters=[(f"added.{k}", p) for k, p in lin2.named_parameters()])
lin2(of(50 + r, (4, 3))).sum().backward()  # the wrapper's add_param_group between backward and step: refused
expect(RuntimeError, lambda: o_p.add_param_group({"params": [extra]}), "add_param_group() was called after backward()",
       "'added.weight', 'added.bias' are being averaged", "between steps")
assert len(o_p.param_groups) == 1
o_p.step()
torch.optim.SGD.add_param_group(o_p, {"params": [extra], "lr": 0.5})  # the torch optimizer's own: averaged too
o_p.zero_grad()
(lin2(of(50 + r, (4, 3))).sum(0) * extra).sum().backward()
want = extra.detach() - 0.5 * sum(lin2(of(50 + q, (4, 3))).sum(0).detach() for q in range(n)) / n
o_p.step()
close("a group added with the torch optimizer's add_param_group", extra.detach(), want)
o_p.remove_hooks()

# ---- process sets: collectives, autograd and DistributedOptimizer among a subset of the ranks ----
solo = [hvd.add_process_set([k]) for k in range(n)]  # a set of each single rank
mine = solo[r]
assert mine.rank() == 0 and mine.size() == 1
w = torch.full((3,), float(r + 1), requires_grad=True)
got = hvd.allreduce(w, op=hvd.Sum, name="ps.w", process_set=mine)
got.sum().backward()
assert torch.equal(got.detach(), w.detach()) and torch.equal(w.grad, torch.ones(3)), (got, w.grad)
gathered = hvd.grouped_allgather([torch.ones(2, 2) * r, torch.arange(r + 1)], name="ps.ga", process_set=mine)
assert torch.equal(gathered[0], torch.ones(2, 2) * r) and torch.equal(gathered[1], torch.arange(r + 1))
everyone = hvd.global_process_set  # every rank: a set of range(n) would duplicate it (an error)
rs = hvd.grouped_reducescatter([torch.ones(2 * n, 2) * (r + 1), torch.ones(n)], op=hvd.Sum, name="ps.rs",
                               process_set=everyone)
assert torch.equal(rs[0], torch.full((2, 2), n * (n + 1) / 2)) and torch.equal(rs[1], torch.full((1,), float(n)))
solo_model = net(300 + r)
solo_opt = hvd.DistributedOptimizer(torch.optim.SGD(solo_model.parameters(), lr=0.1),
                                    named_parameters=solo_model.named_parameters(), process_set=mine)
solo_model(of(r, (8, 4))).sum().backward()
grads = [p.grad.clone() for p in solo_model.parameters()]
solo_opt.step()  # a set of one rank: its own gradients, not averaged with the other ranks'
assert all(torch.equal(g, p.grad) for g, p in zip(grads, solo_model.parameters()))
solo_opt.remove_hooks()
expect(ValueError, lambda: hvd.allreduce(x, process_set=solo[(r + 1) % n]), f"rank {r} is not in process set")
for ps in solo:
    assert hvd.remove_process_set(ps)
checks += 5
if n == 3:  # overlapping sets, an optimizer without named_parameters on each: rank 1 has two; the unnamed ones were
    # numbered per process, so its second was 'noname1' where rank 2's was 'noname' (a TensorMismatchError)
    pairs = [hvd.add_process_set([0, 1]), hvd.add_process_set([1, 2])]
    for i, ps in enumerate(pairs):
        if ps.included():
            pair_model, pair_ref = net(400 + i), net(400 + i)
            pair_opt = hvd.DistributedOptimizer(torch.optim.SGD(pair_model.parameters(), lr=0.1), process_set=ps)
            pair_model(of(r, (6, 4), seed=70)).pow(2).sum().backward()
            pair_opt.step()
            (sum(pair_ref(of(k, (6, 4), seed=70)).pow(2).sum() for k in ps.ranks) / 2).backward()
            torch.optim.SGD(pair_ref.parameters(), lr=0.1).step()
            for p, q in zip(pair_model.parameters(), pair_ref.parameters()):
                assert torch.allclose(p, q, rtol=1e-12, atol=1e-12), f"set {ps.ranks}: {(p - q).abs().max()}"
            pair_opt.remove_hooks()
    for ps in pairs:
        assert hvd.remove_process_set(ps)
checks += 1
expect(ValueError, lambda: hvd.allreduce(x, average=True, op=hvd.Sum), "not both")

# ---- objects, barrier, join ---------------------------------------------------------------------
assert hvd.broadcast_object({"r": r}, root_rank=n - 1) == {"r": n - 1}
assert hvd.allgather_object(r * 2) == [2 * k for k in range(n)]
hvd.barrier()
assert hvd.join() in range(n)
checks += 3
# uneven data: rank 0 has no batch at all, so it joins before the others' first step, whose buckets agree
# without it (that agreement was an allgather, which a joined rank cannot take part in: an error naming an
# internal tensor); the joined rank contributes zeros, so the others' gradients are summed over them / n
uneven, uneven_ref = net(330), net(330)
uneven_opt = hvd.DistributedOptimizer(torch.optim.SGD(uneven.parameters(), lr=0.1),
                                      named_parameters=[(f"uneven.{k}", p) for k, p in uneven.named_parameters()])
uneven_ref_opt = torch.optim.SGD(uneven_ref.parameters(), lr=0.1)
batches = [0] + [2] * (n - 1)


def uneven_batch(k, i):
    g = torch.Generator().manual_seed(1000 * k + i)
    return torch.randn(5, 4, generator=g, dtype=torch.float64)


for i in range(batches[r]):
    uneven_opt.zero_grad()
    uneven(uneven_batch(r, i)).pow(2).mean().backward()
    uneven_opt.step()
# the ranks with data join last: one of them is the last to join (the highest where they join in one cycle; at 3
# ranks ranks 1 and 2 may also join in two, either first), the same answer on every rank
last = hvd.join()
assert batches[last] and hvd.allgather_object(last) == [last] * n, (last, batches)
for i in range(max(batches)):
    total = [torch.zeros_like(p) for p in uneven_ref.parameters()]
    for k in range(n):
        if i < batches[k]:
            uneven_ref.zero_grad()
            uneven_ref(uneven_batch(k, i)).pow(2).mean().backward()
            total = [t + p.grad for t, p in zip(total, uneven_ref.parameters())]
    for t, p in zip(total, uneven_ref.parameters()):
        p.grad = t / n
    uneven_ref_opt.step()
if batches[r]:
    for i, (p, q) in enumerate(zip(uneven.parameters(), uneven_ref.parameters())):
        close(f"uneven data, parameter {i}", p.detach(), q.detach(), 1e-12)
else:
    checks += 6
# the next epoch of the same loop: rank 0 now has the most batches. Its first step sets up its buckets with the
# layout the others agreed while it was joined (it ran that setup alone: a wait for ever), and its second step
# skips the same-start check the others made in the first epoch (it waited for them at their fourth step)
hvd.broadcast_parameters(uneven.state_dict(), root_rank=last)
batches2 = [3] + [1] * (n - 1)
for i in range(batches2[r]):
    uneven_opt.zero_grad()
    uneven(uneven_batch(r, 100 + i)).pow(2).mean().backward()
    uneven_opt.step()
hvd.broadcast_parameters(uneven.state_dict(), root_rank=hvd.join())  # (rank 0 stepped last)
for i in range(max(batches2)):
    total = [torch.zeros_like(p) for p in uneven_ref.parameters()]
    for k in range(n):
        if i < batches2[k]:
            uneven_ref.zero_grad()
            uneven_ref(uneven_batch(k, 100 + i)).pow(2).mean().backward()
            total = [t + p.grad for t, p in zip(total, uneven_ref.parameters())]
    for t, p in zip(total, uneven_ref.parameters()):
        p.grad = t / n
    uneven_ref_opt.step()
for i, (p, q) in enumerate(zip(uneven.parameters(), uneven_ref.parameters())):
    close(f"uneven data, second epoch, parameter {i}", p.detach(), q.detach(), 1e-12)

# an optimizer made before shutdown() steps on after init() again (Horovod's elastic reset does this); its
# buckets went on submitting to the stopped engine: "aiacc was shut down", with aiacc running again
again_model, again_ref = net(320), net(320)
again_opt = hvd.DistributedOptimizer(torch.optim.SGD(again_model.parameters(), lr=0.1),
                                     named_parameters=[(f"again.{k}", p) for k, p in again_model.named_parameters()])
again_ref_opt = torch.optim.SGD(again_ref.parameters(), lr=0.1)
# and one made before shutdown() whose first step comes after init(): its first step's agreement on the buckets went
# to the stopped engine ("ShutdownError: ... 'aiacc.buckets.0.size': aiacc was shut down", aiacc running)
late_model, late_ref = net(330), net(330)
late_opt = hvd.DistributedOptimizer(torch.optim.SGD(late_model.parameters(), lr=0.1),
                                    named_parameters=[(f"late.{k}", p) for k, p in late_model.named_parameters()])
late_ref_opt = torch.optim.SGD(late_ref.parameters(), lr=0.1)
for step in range(3):
    if step == 1:
        hvd.shutdown()
        hvd.init()
    pairs = [(again_model, again_opt, again_ref, again_ref_opt)] + \
        ([(late_model, late_opt, late_ref, late_ref_opt)] if step else [])
    for model_, opt_, ref_, ref_opt_ in pairs:
        opt_.zero_grad()
        model_(of(r, (6, 4), seed=60 + step)).pow(2).sum().backward()
        opt_.step()
        ref_opt_.zero_grad()
        (sum(ref_(of(k, (6, 4), seed=60 + step)).pow(2).sum() for k in range(n)) / n).backward()
        ref_opt_.step()
for p, q in zip(again_model.parameters(), again_ref.parameters()):
    close("stepped across a re-init", p.detach(), q.detach(), tol=1e-9)
for p, q in zip(late_model.parameters(), late_ref.parameters()):
    close("first stepped after a re-init", p.detach(), q.detach(), tol=1e-9)
# Horovod's mpi_ops module holds the basics too (``from horovod.torch.mpi_ops import Sum, rank``)
from aiacc.torch import mpi_ops as horovod_mpi_ops  # noqa: E402

assert (horovod_mpi_ops.Sum, horovod_mpi_ops.Adasum, horovod_mpi_ops.rank(), horovod_mpi_ops.size()) == \
    (hvd.Sum, hvd.Adasum, r, n)
checks += 1
hvd.shutdown()


# a step after shutdown() (a watchdog thread's, mid-training): the bucket's ShutdownError; it was "NotInitializedError:
# aiacc.engine_for() was called after aiacc.shutdown()", naming a call the script never made
def step_after_shutdown():
    again_opt.zero_grad()
    again_model(of(r, (6, 4), seed=70)).pow(2).sum().backward()
    again_opt.step()


raises(aiacc.ShutdownError, step_after_shutdown, "cannot submit allreduce of tensor 'bucket[", "shut down")
checks += 1
say(f"OK rank={r} checks={checks}")
sys.exit(0)
