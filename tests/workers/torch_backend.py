"""torch.distributed on the ``aiacc`` backend: dist.init_process_group("aiacc") under aiaccrun.

Every collective against a reference computed on each rank from what every rank contributed; bad
input (an unsupported op, wrong sizes) as errors that say what; and DDP (plain, with
a communication hook, with gradients as bucket views; static_graph, find_unused_parameters, no_sync() and
allreduce_hook as over gloo), ZeroRedundancyOptimizer and FSDP2 training
equal to one process training on the whole batch.
"""

import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

import aiacc.exceptions as hvd_errors
import aiacc.torch  # noqa: F401 - registers the backend
from one_process import Checks
from report import raises, say

warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecated names, used on purpose
torch.set_num_threads(1)
dist.init_process_group("aiacc")
r, n = dist.get_rank(), dist.get_world_size()
assert dist.get_backend() == "aiacc", dist.get_backend()
assert (r, n) == (aiacc.torch.rank(), aiacc.torch.size())
checks = Checks(rank=r)
same = checks.equal


def of(k, shape=(5, 3), dtype=torch.float32):
    """Rank k's contribution."""
    g = torch.Generator().manual_seed(100 + k)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 1 << 12, shape, generator=g).to(dtype)


every = lambda dtype=torch.float32, shape=(5, 3): torch.stack([of(k, shape, dtype) for k in range(n)])  # noqa: E731

# ---- all_reduce with every op ------------------------------------------------------------------
for op, ref in [(dist.ReduceOp.SUM, lambda a: a.sum(0)), (dist.ReduceOp.AVG, lambda a: a.mean(0)),
                (dist.ReduceOp.MIN, lambda a: a.min(0).values), (dist.ReduceOp.MAX, lambda a: a.max(0).values),
                (dist.ReduceOp.PRODUCT, lambda a: a.prod(0))]:
    t = of(r, dtype=torch.float64)
    dist.all_reduce(t, op=op)
    same(f"all_reduce {op}", t, ref(every(torch.float64)), 1e-12)
for op, fn in [(dist.ReduceOp.BAND, torch.bitwise_and), (dist.ReduceOp.BOR, torch.bitwise_or),
               (dist.ReduceOp.BXOR, torch.bitwise_xor)]:
    for dtype in (torch.int32, torch.int64, torch.uint8):
        t = of(r, dtype=dtype)
        dist.all_reduce(t, op=op)
        want = of(0, dtype=dtype)
        for k in range(1, n):
            want = fn(want, of(k, dtype=dtype))
        same(f"all_reduce {op} {dtype}", t, want)
t = of(r).t()  # not contiguous: reduced through a staged copy, back in place
dist.all_reduce(t)
same("all_reduce of a transposed view", t, every().sum(0).t(), 1e-5)

# ---- async work and futures -------------------------------------------------------------------
t = of(r)
work = dist.all_reduce(t, async_op=True)
fut = work.get_future().then(lambda f: f.value()[0] * 2)
assert work.wait() is True
same("async all_reduce", t, every().sum(0), 1e-5)
same("future chained on the engine's completion", fut.wait(), every().sum(0) * 2, 1e-5)
# is_completed() polled (no wait): the outputs are filled when it says so, as over gloo (a list's, a strided
# tensor's copy came at the wait only: it said done with them unwritten)
outs, t = [torch.full((5, 3), -1.0) for _ in range(n)], of(r).t()
works = [dist.all_gather(outs, of(r), async_op=True), dist.all_reduce(t, async_op=True)]
while not all(w.is_completed() for w in works):
    time.sleep(0.001)
same("all_gather polled with is_completed()", torch.stack(outs), every())
same("all_reduce of a transposed view polled with is_completed()", t, every().sum(0).t(), 1e-5)
assert all(w.is_success() and w.exception() is None and w.wait() for w in works)

# ---- gather, scatter, broadcast, alltoall -----------------------------------------------------
outs = [torch.empty(5, 3) for _ in range(n)]
dist.all_gather(outs, of(r))
for k in range(n):
    same(f"all_gather[{k}]", outs[k], of(k))
out = torch.empty(n * 5, 3)
dist.all_gather_into_tensor(out, of(r))
same("all_gather_into_tensor", out, every().reshape(n * 5, 3))
shard = out.chunk(n)[r]  # FSDP's in-place form: the input is this rank's piece of the output
shard.copy_(of(r) + 1)
dist.all_gather_into_tensor(out, shard)
same("all_gather_into_tensor in place", out, (every() + 1).reshape(n * 5, 3))
full = torch.stack([of(k, (n * 2, 3)) for k in range(n)])
out = torch.empty(2, 3)
dist.reduce_scatter_tensor(out, of(r, (n * 2, 3)), op=dist.ReduceOp.SUM)
same("reduce_scatter_tensor", out, full.sum(0)[2 * r:2 * r + 2], 1e-5)
dist.reduce_scatter(out, list(of(r, (n * 2, 3)).chunk(n)), op=dist.ReduceOp.MAX)
same("reduce_scatter (list)", out, full.max(0).values[2 * r:2 * r + 2])
# in place (the engine sends an input that overlaps the output from a copy: MPI refuses aliased buffers):
# the output is this rank's block of the input, and all_to_all_single into its own input
buf = of(r, (n * 2, 3)).clone()
mine = buf[2 * r:2 * r + 2]
dist.reduce_scatter_tensor(mine, buf, op=dist.ReduceOp.SUM)
same("reduce_scatter_tensor in place", mine, full.sum(0)[2 * r:2 * r + 2], 1e-5)
buf = of(r, (n * 2, 3)).clone()
dist.all_to_all_single(buf, buf)
same("all_to_all_single in place", buf, torch.cat([of(k, (n * 2, 3))[2 * r:2 * r + 2] for k in range(n)]))
for root in range(n):
    t = of(r, dtype=torch.int64)
    dist.broadcast(t, src=root)
    same(f"broadcast from {root}", t, of(root, dtype=torch.int64))
# the process group's short forms (one tensor, then the op or the root), as torch's own code calls them (DDP under Join)
t = of(r)
dist.group.WORLD.allreduce(t, dist.ReduceOp.MAX).wait()
same("group.allreduce(tensor, op)", t, every().max(0).values)
t = of(r)
dist.group.WORLD.broadcast(t, n - 1).wait()
same("group.broadcast(tensor, root)", t, of(n - 1))
# uneven all_to_all_single: rank k sends k+1+j rows to rank j
rows = lambda k, j: k + 1 + j  # noqa: E731
send = torch.cat([torch.full((rows(r, j), 2), float(10 * r + j)) for j in range(n)])
recv = torch.empty(sum(rows(k, r) for k in range(n)), 2)
dist.all_to_all_single(recv, send, [rows(k, r) for k in range(n)], [rows(r, j) for j in range(n)])
same("all_to_all_single (uneven)", recv, torch.cat([torch.full((rows(k, r), 2), float(10 * k + r)) for k in range(n)]))
outs = [torch.empty(2) for _ in range(n)]
dist.all_to_all(outs, [torch.full((2,), float(10 * r + j)) for j in range(n)])
for k in range(n):
    same(f"all_to_all[{k}]", outs[k], torch.full((2,), float(10 * k + r)))
dist.barrier()
for dtype in (torch.float32, torch.bfloat16):  # (bfloat16: mpi4py cannot take ml_dtypes' numpy dtype)
    if r == 0:
        dist.send(torch.arange(4.0).to(dtype), dst=n - 1, tag=3)
    if r == n - 1:
        got = torch.empty(4, dtype=dtype)
        dist.recv(got, src=0, tag=3)
        same(f"send / recv {dtype}", got, torch.arange(4.0).to(dtype))
    else:
        checks.count += 1
# a receive of another size or dtype than the send: an error naming both, the job goes on (a float32 message into a
# float64 tensor ended the whole job on an MPICH assertion; a longer one was mpi4py's bare "Message truncated")
for sent, into, came in [(torch.ones(3), torch.zeros(3, dtype=torch.float64), "has 12 bytes"),
                         (torch.ones(5), torch.zeros(3), "has more than 12 bytes"),
                         (torch.ones(3), torch.zeros(5), "has 12 bytes")]:
    if r == 0:
        dist.send(sent, dst=n - 1, tag=4)
    if r == n - 1:
        raises(ValueError, lambda: dist.recv(into, src=0, tag=4), "recv from rank 0, tag 4", came,
               f"{str(into.dtype).replace('torch.', '')} of shape {tuple(into.shape)}, has {into.numel() * into.element_size()} bytes")
    checks.count += 1
objs = [None] * n
dist.all_gather_object(objs, {"rank": r})
assert objs == [{"rank": k} for k in range(n)], objs
checks.count += 1

# ---- reduce, gather, scatter (and the object collectives torch builds on them), every root -------
# a dst that differs across ranks: an error on every rank (each rank naming itself kept the sum: no error, gloo fails)
raises(hvd_errors.TensorMismatchError, lambda: dist.reduce(of(r, dtype=torch.float64), dst=r),
       "'c10d.reduce.", "root rank differs across ranks (rank 0: 0; rank 1: 1")
t = of(r, dtype=torch.float64).t()  # strided: the root's is reduced in a copy and copied back
dist.reduce(t, dst=n - 1)
same("reduce of a strided tensor", t, every(torch.float64).sum(0).t() if r == n - 1 else of(r, dtype=torch.float64).t(),
     1e-12)
checks.count += 1  # (the raises; same() counts itself)
for root in range(n):
    for op, ref in [(dist.ReduceOp.SUM, lambda a: a.sum(0)), (dist.ReduceOp.MAX, lambda a: a.max(0).values)]:
        t = of(r, dtype=torch.float64)
        dist.reduce(t, dst=root, op=op)
        same(f"reduce {op} to {root}", t, ref(every(torch.float64)) if r == root else of(r, dtype=torch.float64),
             1e-12)
    gathered = [torch.full((5, 3), -1) for _ in range(n)] if r == root else None
    dist.gather(of(r, dtype=torch.int64), gathered, dst=root)
    if r == root:
        for k in range(n):
            same(f"gather to {root} [{k}]", gathered[k], of(k, dtype=torch.int64))
    t = torch.full((2, 3), -1.0)
    dist.scatter(t, [torch.full((2, 3), float(10 * root + k)) for k in range(n)] if r == root else None, src=root)
    same(f"scatter from {root}", t, torch.full((2, 3), float(10 * root + r)))
    objs = [None] * n if r == root else None
    dist.gather_object({"rank": r, "pad": "x" * 100 * r}, objs, dst=root)
    assert objs == ([{"rank": k, "pad": "x" * 100 * k} for k in range(n)] if r == root else None), objs
    got = [None]
    dist.scatter_object_list(got, [("to", k) for k in range(n)] if r == root else None, src=root)
    assert got == [("to", r)], got
    checks.count += 2

# ---- two groups over the same ranks: each has its own operations, in any order across them --------
g2, g3 = dist.new_group(list(range(n))), dist.new_group(list(range(n)))  # two new groups: their first operations
assert dist.get_backend(g2) == dist.get_backend(g3) == "aiacc"
a, b = torch.full((3,), float(r + 1)), torch.full((3,), 100.0 * (r + 1))
if r % 2:  # odd ranks start on g3, even ranks on g2: as over gloo, both finish
    work = dist.all_reduce(b, group=g3, async_op=True)
    dist.all_reduce(a, group=g2)
else:
    work = dist.all_reduce(a, group=g2, async_op=True)
    dist.all_reduce(b, group=g3)
work.wait()
total = n * (n + 1) / 2
same("all_reduce on g2 beside g3", a, torch.full((3,), total))
same("all_reduce on g3 beside g2", b, torch.full((3,), 100 * total))

# ---- bad input: errors that say what, no hang -------------------------------------------------
raises(ValueError, lambda: dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0)),
       "all_reduce with RedOpType.PREMUL_SUM is not supported")  # (not the op object's repr)
raises(TypeError, lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND), "bitwise", "float32")
raises(ValueError, lambda: dist.all_gather_into_tensor(torch.empty(3), torch.ones(2)), "all_gather_into_tensor",
       "output has size 3", f"expected {2 * n}")
send = torch.arange(2.0 * n)  # two rows to every rank
raises(ValueError, lambda: dist.all_to_all_single(torch.empty(2 * n), send, [3] + [2] * (n - 2) + [1], [2] * n),
       "all_to_all_single", f"output_split_sizes {[3] + [2] * (n - 2) + [1]}", f"sent {[2] * n} rows")
raises(ValueError, lambda: dist.all_to_all_single(torch.empty(2 * n + 1), send), "all_to_all_single",
       f"output has size {2 * n + 1}", f"{2 * n} rows")
# reduce_scatter's input list: each tensor the output's size (a 3 and a 1 summing to two 2s were cut as 2 and 2)
raises(ValueError, lambda: dist.reduce_scatter(torch.empty(2), [torch.ones(3), torch.ones(1)] + [torch.ones(2)] * (n - 2)),
       "reduce_scatter", "input_list[0] has size 3", "expected 2")
# an output of another dtype than the input (torch checks the other collectives' itself): float32 gathered into
# float64 was garbage, a reduce-scatter of them ended the job from the engine's thread
raises(ValueError, lambda: dist.all_gather_into_tensor(torch.empty(2 * n, dtype=torch.float64), torch.ones(2)),
       "all_gather_into_tensor", "the output is float64, the input float32")
raises(ValueError, lambda: dist.reduce_scatter_tensor(torch.empty(2, dtype=torch.bfloat16), torch.ones(2 * n)),
       "reduce_scatter_tensor", "the output is bfloat16, the input float32")
# inputs of different sizes across ranks: an error naming the collective (it was a bare reshape error)
mine = 2 if r == 0 else 3  # rank 0 gives 2 elements, the others 3: no rank's output has the size of all
raises(ValueError, lambda: dist.all_gather_into_tensor(torch.empty(n * mine), torch.ones(mine)),
       f"all_gather_into_tensor on rank {r}: the output has size {n * mine}", f"{2 + 3 * (n - 1)} elements arrived")
# ... found as the result lands: every reader gets it, not only the first (a poll's, the future's: then wait() and the
# future returned the output unwritten, and functional collectives returned uninitialized memory, exit 0)
w = dist.all_gather_into_tensor(torch.full((n * mine,), -7.0), torch.ones(mine), async_op=True)
while not w.is_completed():
    time.sleep(0.001)
assert "elements arrived" in str(w.exception()), w.exception()
for reader in (w.wait, w.wait, lambda: w.get_future().wait()):
    raises((ValueError, RuntimeError), reader, f"all_gather_into_tensor on rank {r}", "elements arrived")
import torch.distributed._functional_collectives as funcol  # noqa: E402
raises((ValueError, RuntimeError), lambda: funcol.all_gather_tensor(torch.ones(mine), 0, dist.group.WORLD) + 0,
       f"all_gather_into_tensor on rank {r}", "elements arrived")
raises(NotImplementedError, lambda: dist.all_gather_coalesced([[torch.empty(2) for _ in range(n)]], [torch.ones(2)]),
       "aiacc backend: all_gather_coalesced", "not supported")  # (torch's: "No backend type associated ...")
sub = dist.new_group([0])  # a sub-group, rank 0 alone (tests/workers/torch_subgroups.py has them all)
if r == 0:
    t = torch.full((2,), 5.0)
    dist.all_reduce(t, group=sub)
    assert torch.equal(t, torch.full((2,), 5.0)), t
else:
    assert sub == dist.GroupMember.NON_GROUP_MEMBER  # torch builds nothing off the group
checks.count += 13


# ---- training: DDP, its comm hooks, ZeroRedundancyOptimizer, FSDP2 -----------------------------
def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 16),
                         nn.Tanh(), nn.Linear(16, 10))


BATCH, STEPS = 12, 8
g = torch.Generator().manual_seed(7)
DATA = [(torch.randn(BATCH, 1, 8, 8, generator=g), torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(STEPS)]


def train(model, opt, whole):
    rows = slice(0, BATCH) if whole else slice(r * BATCH // n, (r + 1) * BATCH // n)
    for x, y in DATA:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()
    return model


ref_model = net()
train(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9), True)
want = [p.detach().clone() for p in ref_model.parameters()]


def equal_to_reference(name, params, tol=1e-5):
    for i, (p, w) in enumerate(zip(params, want)):
        same(f"{name} parameter {i}", p.detach(), w, tol)


from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

for label, kwargs, hook, tol in [("DDP", {}, None, 1e-5),
                                 ("DDP gradient_as_bucket_view, 1 KiB buckets",
                                  {"gradient_as_bucket_view": True, "bucket_cap_mb": 1 / 1024}, None, 1e-5),
                                 ("DDP fp16_compress_hook", {}, default_hooks.fp16_compress_hook, 2e-3)]:
    model = DDP(net(), **kwargs)
    if hook is not None:
        model.register_comm_hook(None, hook)
    train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), False)
    equal_to_reference(label, model.module.parameters(), tol)

# torch.compile(DDP(model)): torch's C++ calls the group's Python methods while the compiled frame runs (DDP's
# bucket rebuild in the second step), which dynamo took for user code to trace and failed on
model = DDP(net())
train(torch.compile(model, backend="aot_eager"), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), False)
equal_to_reference("torch.compile(DDP)", model.module.parameters())

# two DDP models in one backward, each on a group of its own: their buckets interleave
first, second = DDP(net(), process_group=g2), DDP(net(), process_group=g3)
opt = torch.optim.SGD(list(first.parameters()) + list(second.parameters()), lr=0.1, momentum=0.9)
for x, y in DATA:
    opt.zero_grad()
    rows = slice(r * BATCH // n, (r + 1) * BATCH // n)
    (nn.functional.cross_entropy(first(x[rows]), y[rows]) + nn.functional.cross_entropy(second(x[rows]), y[rows])).backward()
    opt.step()
equal_to_reference("DDP beside a DDP on another group (first)", first.module.parameters())
equal_to_reference("DDP beside a DDP on another group (second)", second.module.parameters())

# a future's callback that starts another collective and waits for it (torch's PowerSGD hook does): it waited
# forever, the callback running on the engine's own thread
t, u = torch.ones(4), torch.ones(2) * (r + 1)
fut = dist.all_reduce(t, async_op=True).get_future().then(lambda _: dist.all_reduce(u, async_op=True).get_future().wait()[0])
same("a collective waited for inside a future's callback", fut.wait(), torch.full((2,), n * (n + 1) / 2))
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook  # noqa: E402

model = DDP(net())
state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                    min_compression_rate=0.5)
model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), False)
flat = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
gathered = [torch.empty_like(flat) for _ in range(n)]
dist.all_gather(gathered, flat)
assert all(torch.equal(g, flat) for g in gathered), "DDP with PowerSGD: the ranks' parameters differ"
checks.count += 1

# DDP under Join with uneven inputs, dividing by the ranks still training (divide_by_initial_world_size=False):
# the reducer keeps the forward pass's allreduce and waits for it in backward; it waited forever (the Work's
# Python object was gone). Rank k trains 2 + k steps; each step's gradient is the mean over the ranks in it.
from torch.distributed.algorithms.join import Join  # noqa: E402

# With find_unused_parameters=True a joined rank also reduces its map of used parameters, through the group's
# short form allreduce(tensor): its elements were taken for tensors of their own (a mismatch error, the job aborted).
ref_model = net()
ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
for step, (x, y) in enumerate(DATA[:2 + n - 1]):
    ref_opt.zero_grad()
    active = [k for k in range(n) if step < 2 + k]
    (sum(nn.functional.cross_entropy(ref_model(x[k::n]), y[k::n]) for k in active) / len(active)).backward()
    ref_opt.step()
for unused in (False, True):
    model = DDP(net(), find_unused_parameters=unused)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Join([model], divide_by_initial_world_size=False):
        for x, y in DATA[:2 + r]:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[r::n]), y[r::n]).backward()
            opt.step()
    for i, (p, q) in enumerate(zip(model.module.parameters(), ref_model.parameters())):
        same(f"DDP under Join (uneven inputs, find_unused_parameters={unused}) parameter {i}", p.detach(), q.detach(),
             1e-5)

# DDP's other options on the aiacc backend against DDP on gloo in the same job (each rank's parameters, after
# 6 steps): static_graph (also with gradient_as_bucket_view), find_unused_parameters with a branch only rank 0 takes
# in odd steps, no_sync() accumulation, torch's allreduce_hook
gloo = dist.new_group(backend="gloo")


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.side = nn.Linear(6, 8), nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x, side=True):
        h = torch.tanh(self.a(x))
        return self.b(h) + self.side(h) if side else self.b(h)


def ddp_features(pg, kwargs, hook=None, mode=""):
    model = DDP(Branchy(), process_group=pg, **kwargs)
    if hook is not None:
        model.register_comm_hook(pg, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step, (x, _) in enumerate(DATA[:6]):
        x, y = x.reshape(BATCH, -1)[r::n, :6], x.reshape(BATCH, -1)[r::n, 6:10]
        opt.zero_grad()
        if mode == "no_sync":
            with model.no_sync():
                nn.functional.mse_loss(model(x[:2]), y[:2]).backward()
            nn.functional.mse_loss(model(x[2:]), y[2:]).backward()
        else:
            nn.functional.mse_loss(model(x, side=mode != "branch" or (r == 0 and step % 2 == 1)), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])


for label, kwargs, hook, mode in [
        ("static_graph", {"static_graph": True}, None, ""),
        ("static_graph, gradient_as_bucket_view", {"static_graph": True, "gradient_as_bucket_view": True}, None, ""),
        ("find_unused_parameters, a branch rank 0 takes in odd steps", {"find_unused_parameters": True}, None,
         "branch"),
        ("no_sync() accumulation", {}, None, "no_sync"), ("allreduce_hook", {}, default_hooks.allreduce_hook, "")]:
    same(f"DDP {label}: as on gloo", ddp_features(None, kwargs, hook, mode), ddp_features(gloo, kwargs, hook, mode),
         1e-6)

model = DDP(net())
train(model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9), False)
equal_to_reference("DDP + ZeroRedundancyOptimizer", model.module.parameters())

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

model = net()
mesh = init_device_mesh("cpu", (n,))
for layer in model:
    if isinstance(layer, (nn.Linear, nn.Conv2d)):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), False)
equal_to_reference("FSDP2 fully_shard", [p.full_tensor() for p in model.parameters()])

# async Works never waited for (nor their futures) are not all kept: every one was, with its tensors (a leak
# of the tensors' size per step, where gloo frees them); the newest UNWAITED_KEPT stay for torch's C++
from aiacc.torch import works as aiacc_works  # noqa: E402

for _ in range(3 * aiacc_works.UNWAITED_KEPT):
    dist.all_reduce(torch.ones(16), async_op=True)
dist.barrier()
dist.all_reduce(torch.ones(16), async_op=True).wait()
kept = len(aiacc_works._unwaited)
assert kept <= aiacc_works.UNWAITED_KEPT + 1, kept
checks.count += 1

dist.destroy_process_group()
say(f"OK rank={r} checks={checks.count}")
