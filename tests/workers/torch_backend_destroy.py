"""dist.destroy_process_group() with a collective still in flight on a group over every rank (never waited for):
it ends first, its result in the tensor, as over gloo. (It ran later on the job's engine, after the group was gone:
the tensor was still the rank's own value after destroy, and a buffer reused meanwhile was overwritten.) Then the
default group is made again and works."""

import os

import torch
import torch.distributed as dist

import aiacc.torch  # noqa: F401 - registers the "aiacc" backend
from report import say

torch.set_num_threads(1)
checks = 0
for round_ in range(2):
    dist.init_process_group("aiacc")
    r, n = dist.get_rank(), dist.get_world_size()
    total = float(sum(range(1, n + 1)))
    z = torch.full((1 << 12,), float(r + 1))
    work = dist.all_reduce(z, async_op=True)  # (never waited for)
    sub = dist.new_group(list(range(n)))  # a further group over every rank: destroyed alone first
    y = torch.full((5,), float(r + 1))
    sub_work = dist.all_reduce(y, group=sub, async_op=True)
    dist.destroy_process_group(sub)
    assert torch.equal(y, torch.full((5,), total)), f"rank {r}: after destroying the group, {y[:3].tolist()}"
    dist.destroy_process_group()
    assert torch.equal(z, torch.full((1 << 12,), total)), f"rank {r}: after destroy, {z[:3].tolist()}"
    z.fill_(-1.0)  # the script reuses the buffer: nothing of the destroyed group may write into it now
    y.fill_(-1.0)
    assert work.is_completed() and sub_work.is_completed()
    checks += 2
    os.sched_yield()
assert torch.equal(z, torch.full((1 << 12,), -1.0)) and torch.equal(y, torch.full((5,), -1.0)), f"rank {r}: overwritten"
say(f"OK rank={r} checks={checks}")
