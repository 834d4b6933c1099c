"""torch.distributed sub-groups on the ``aiacc`` backend, at 3 ranks: ``dist.new_group([0, 2])`` (torch builds its
backend on ranks 0 and 2 only; rank 1 calls nothing on it).

Every collective on the sub-group equals the reference computed from its members' data, while rank 1 runs
collectives on a group of its own (``dist.new_group([1])``) and an operation of the default group is in
flight on every rank; the default group still works after; DDP over the sub-group trains to the parameters
of one process on the members' whole batch (rank 1 beside it: DDP over its group of one on its own batch);
aiacc's SyncBatchNorm over the sub-group (``process_group=g``) equals one BatchNorm over the members' batch;
``dist.new_subgroups(group_size=1)`` and ``new_subgroups_by_enumeration``; ``use_local_synchronization=True``
(only the members call ``new_group``); a group of every rank made after them (rank 0 made one group fewer)
beside the default group; ``destroy_process_group(g)`` stops the group for its members (an
operation after it is an error naming it) and the other groups go on.
"""

import threading
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

import aiacc.torch  # noqa: F401 - registers the backend
from one_process import Checks
from report import raises, say

warnings.filterwarnings("ignore", category=FutureWarning)
torch.set_num_threads(1)
dist.init_process_group("aiacc")
r, n = dist.get_rank(), dist.get_world_size()
assert n == 3, n
MEMBERS = [0, 2]
checks = Checks(rank=r)
same = checks.equal


def of(k, shape=(4, 3), dtype=torch.float64):
    """Rank k's contribution."""
    g = torch.Generator().manual_seed(100 + k)
    return torch.randn(shape, generator=g).to(dtype)


g = dist.new_group(MEMBERS)
solo = dist.new_group([1])
assert (g == dist.GroupMember.NON_GROUP_MEMBER) == (r == 1)
assert (solo == dist.GroupMember.NON_GROUP_MEMBER) == (r != 1)

# an operation of the default group in flight on every rank while the members run the sub-group's: rank 1's
# waits for the members', which come after their sub-group's work
pending = torch.full((2,), float(r + 1))
world_work = dist.all_reduce(pending, async_op=True)

if r in MEMBERS:
    me = MEMBERS.index(r)
    assert dist.get_backend(g) == "aiacc" and dist.get_world_size(g) == 2 and dist.get_rank(g) == me
    members = torch.stack([of(k) for k in MEMBERS])
    t = of(r)
    dist.all_reduce(t, group=g)
    same("all_reduce SUM on [0, 2]", t, members.sum(0), 1e-12)
    t = of(r)
    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=g)
    same("all_reduce AVG on [0, 2]", t, members.mean(0), 1e-12)
    t = of(r)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
    same("all_reduce MAX on [0, 2]", t, members.max(0).values)
    for src in MEMBERS:  # src: the global rank
        t = of(r)
        dist.broadcast(t, src=src, group=g)
        same(f"broadcast from {src} on [0, 2]", t, of(src))
    outs = [torch.empty(4, 3, dtype=torch.float64) for _ in MEMBERS]
    dist.all_gather(outs, of(r), group=g)
    for i, k in enumerate(MEMBERS):
        same(f"all_gather[{i}] on [0, 2]", outs[i], of(k))
    out = torch.empty(8, 3, dtype=torch.float64)
    dist.all_gather_into_tensor(out, of(r), group=g)
    same("all_gather_into_tensor on [0, 2]", out, members.reshape(8, 3))
    out = torch.empty(2, 3, dtype=torch.float64)
    dist.reduce_scatter_tensor(out, of(r), group=g)
    same("reduce_scatter_tensor on [0, 2]", out, members.sum(0)[2 * me:2 * me + 2], 1e-12)
    out = torch.empty(4, 3, dtype=torch.float64)
    dist.all_to_all_single(out, of(r), group=g)
    same("all_to_all_single on [0, 2]", out, torch.cat([of(k)[2 * me:2 * me + 2] for k in MEMBERS]))
    t = of(r)
    dist.reduce(t, dst=2, group=g)
    same("reduce to 2 on [0, 2]", t, members.sum(0) if r == 2 else of(r), 1e-12)
    gathered = [torch.empty(4, 3, dtype=torch.float64) for _ in MEMBERS] if r == 2 else None
    dist.gather(of(r), gathered, dst=2, group=g)
    if r == 2:
        for i, k in enumerate(MEMBERS):
            same(f"gather to 2 [{i}] on [0, 2]", gathered[i], of(k))
    else:
        checks.count += 2
    t = torch.empty(3)
    dist.scatter(t, [torch.full((3,), 10.0 + k) for k in MEMBERS] if r == 2 else None, src=2, group=g)
    same("scatter from 2 on [0, 2]", t, torch.full((3,), 10.0 + r))
    objs = [None, None]
    dist.all_gather_object(objs, {"rank": r}, group=g)
    assert objs == [{"rank": 0}, {"rank": 2}], objs
    if r == 0:
        dist.send(torch.arange(3.0), dst=2, group=g)  # dst: the global rank
        checks.count += 1
    else:
        t = torch.empty(3)
        dist.recv(t, src=0, group=g)
        same("send / recv on [0, 2]", t, torch.arange(3.0))
    dist.barrier(group=g)
    checks.count += 1
else:  # rank 1, meanwhile: collectives on its own group of one
    t = of(r)
    dist.all_reduce(t, group=solo)
    same("all_reduce on [1]", t, of(1))
    out = torch.empty(4, 3, dtype=torch.float64)
    dist.all_gather_into_tensor(out, of(r), group=solo)
    same("all_gather_into_tensor on [1]", out, of(1))
    t = of(r)
    dist.broadcast(t, src=1, group=solo)
    same("broadcast on [1]", t, of(1))
    dist.barrier(group=solo)
    checks.count += 13  # as many as a member's
world_work.wait()
same("default group's all_reduce in flight beside the sub-groups", pending, torch.full((2,), 6.0))
t = torch.full((3,), float(r))
dist.all_reduce(t)
same("default group after the sub-groups", t, torch.full((3,), 3.0))


# ---- DDP over the sub-group: the members' whole batch in one process --------------------------------------
def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


BATCH, STEPS = 8, 5
gen = torch.Generator().manual_seed(7)
DATA = [(torch.randn(BATCH, 6, generator=gen), torch.randint(0, 3, (BATCH,), generator=gen)) for _ in range(STEPS)]


def train(model, rows):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in DATA:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()
    return model


def plain():
    model = net()
    model[1] = nn.Identity()
    return model


ref = train(plain(), slice(0, BATCH))
mine = slice(0, BATCH // 2) if r == 0 else slice(BATCH // 2, BATCH)  # (rank 1: the whole batch, alone)
model = nn.parallel.DistributedDataParallel(plain(), process_group=g if r in MEMBERS else solo)
train(model, mine if r in MEMBERS else slice(0, BATCH))
for i, (p, q) in enumerate(zip(model.module.parameters(), ref.parameters())):
    same(f"DDP over {'[0, 2]' if r in MEMBERS else '[1]'} parameter {i}", p.detach(), q.detach(), 1e-5)

# aiacc's SyncBatchNorm over the sub-group (torch's own refuses CPU tensors on any backend): one BatchNorm over
# the members' batch. The members' DDP with it trains to the plain model on their whole batch.
if r in MEMBERS:
    ref = train(net(), slice(0, BATCH))
    synced = aiacc.torch.SyncBatchNorm.convert_sync_batchnorm(net(), process_group=g)
    assert isinstance(synced[1], aiacc.torch.SyncBatchNorm)
    model = nn.parallel.DistributedDataParallel(synced, process_group=g)
    train(model, mine)
    for i, (p, q) in enumerate(zip(model.module.parameters(), ref.parameters())):
        same(f"DDP + SyncBatchNorm over [0, 2] parameter {i}", p.detach(), q.detach(), 1e-5)
    same("SyncBatchNorm over [0, 2] running_mean", model.module[1].running_mean, ref[1].running_mean, 1e-5)
else:
    checks.count += 7
gloo = dist.new_group(backend="gloo")  # a group of another backend: what it names is not aiacc's to run
raises(ValueError, lambda: aiacc.torch.SyncBatchNorm(4, process_group=gloo), "SyncBatchNorm: process_group must be "
       "a group of the aiacc backend")
checks.count += 1

# ---- new_subgroups, by size and by enumeration; groups made by their members only ---------------------------
mine_of_size_1, all_of_size_1 = dist.new_subgroups(group_size=1)
assert len(all_of_size_1) == 3 and dist.get_world_size(mine_of_size_1) == 1
t = torch.full((2,), float(r))
dist.all_reduce(t, group=mine_of_size_1)
same("all_reduce on new_subgroups(group_size=1)", t, torch.full((2,), float(r)))
mine_enumerated, _ = dist.new_subgroups_by_enumeration([[0, 2], [1]])
t = torch.full((2,), float(r + 1))
dist.all_reduce(t, group=mine_enumerated)
same("all_reduce on new_subgroups_by_enumeration", t, torch.full((2,), 4.0 if r in MEMBERS else 2.0))
if r != 0:  # only ranks 1 and 2 call new_group
    local = dist.new_group([1, 2], use_local_synchronization=True)
    t = torch.full((2,), float(r))
    dist.all_reduce(t, group=local)
    same("all_reduce on new_group([1, 2], use_local_synchronization=True)", t, torch.full((2,), 3.0))
else:
    checks.count += 1

# a group of every rank made now (rank 0 has made one group fewer than the others): its operations have the same
# names on every rank, used in a different order against the default group's on each rank
everyone = dist.new_group([0, 1, 2])
a, b = torch.full((2,), float(r)), torch.full((2,), 10.0 * r)
if r == 1:
    work = dist.all_reduce(b, group=everyone, async_op=True)
    dist.all_reduce(a)
else:
    work = dist.all_reduce(a, async_op=True)
    dist.all_reduce(b, group=everyone)
work.wait()
same("default group beside a group of every rank made after the sub-groups", a, torch.full((2,), 3.0))
same("a group of every rank made after the sub-groups", b, torch.full((2,), 30.0))

# ---- destroy_process_group(g): released; the default group goes on ------------------------------------------
def engine_threads():
    return sum(t.name == "aiacc-engine" for t in threading.enumerate())


before = engine_threads()
dist.barrier()  # (counted before: a member's destroy stops the other member's engine too)
if r in MEMBERS:
    dist.destroy_process_group(g)
    assert engine_threads() == before - 1, (before, engine_threads())  # the sub-group's engine has stopped
    raises(ValueError, lambda: dist.all_reduce(torch.ones(2), group=g), "not initialized")  # (torch's)
    # the group object itself, kept: its engine is gone, an error that says why
    raises(RuntimeError, lambda: g.allreduce(torch.ones(2)).wait(), f"allreduce on the process group of ranks [0, 2], which was destroyed on rank {r}",
           "destroy_process_group")
# one member destroys a group the other still uses: the other's operation fails naming it, no hang
if r == 0:
    dist.destroy_process_group(mine_enumerated)
elif r == 2:
    raises(RuntimeError, lambda: dist.all_reduce(torch.ones(2), group=mine_enumerated),
           "the process group of ranks [0, 2], which was destroyed on rank 0")
checks.count += 2
t = torch.ones(2)
dist.all_reduce(t)
same("default group after destroy_process_group(g)", t, torch.full((2,), 3.0))
dist.destroy_process_group()
say(f"OK rank={r} checks={checks.count}")
