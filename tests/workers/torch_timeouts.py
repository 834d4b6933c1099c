"""torch.distributed timeouts on the ``aiacc`` backend: a peer that never joins is an error after the timeout,
as over gloo, not a wait for ever. One mode per job (``sys.argv[1]``):

``group`` (2 ranks): groups over both ranks made with ``timeout=3 s``. Rank 1 skips an ``all_reduce`` on one:
rank 0's wait on its future (as DDP waits) raises RuntimeError naming the operation, the group, the timeout
and rank 1; the group is unusable after it (an error naming the timeout), the default group still works;
then rank 0's synchronous ``all_reduce`` on the other group, which rank 1 (asleep) skips too, raises and is left
uncaught: the job must end with a non-zero status.

``wait`` (2 ranks, the group's timeout 10 min): ``work.wait(timeout=2 s)`` on an ``all_reduce`` rank 1 has not
joined raises naming ``work.wait`` and rank 1; the operation still runs: once rank 1 joins it (told by a
``send``), ``work.wait()`` returns the sum.

``new_group`` (3 ranks): rank 0 calls ``new_group([0, 2], use_local_synchronization=True, timeout=3 s)``, member 2
does not: rank 0 gets a RuntimeError naming rank 2 (``MPI_Comm_create_group`` waited for ever). Member 2 calls it
later (told by a ``send``): an error saying rank 0 gave up, not a wait for ever. The default group still works.
"""

import datetime
import sys
import time

import torch
import torch.distributed as dist

import aiacc.torch  # noqa: F401 - registers the backend
from report import raises, say

torch.set_num_threads(1)
MODE = sys.argv[1]
SHORT = datetime.timedelta(seconds=3)
checks = 0


def seen(text: str) -> None:
    global checks
    say(f"ERROR-SEEN rank={r}: {text}")
    checks += 1


def summed(value: float, group=None) -> float:
    t = torch.full((3,), value)
    dist.all_reduce(t, group=group)
    return float(t[0])


if MODE == "group":
    dist.init_process_group("aiacc", timeout=datetime.timedelta(minutes=10))
    r = dist.get_rank()
    f = dist.new_group([0, 1], timeout=SHORT)
    h = dist.new_group([0, 1], timeout=SHORT)
    for group in (None, f, h):  # every group works while both ranks take part
        assert summed(r + 1.0, group) == 3.0
        checks += 1
    if r == 0:
        work = dist.all_reduce(torch.ones(3), group=f, async_op=True)
        seen(raises(RuntimeError, work.get_future().wait, "Timed out waiting 3000ms for allreduce", "rank 0 of the "
                    "process group", "of ranks [0, 1]", "timeout 0:00:03", "rank 1 has not joined it (rank 0 did)",
                    "unusable from now on"))
        seen(raises(RuntimeError, lambda: summed(1.0, f), "allreduce on the process group",
                    "unusable since an earlier wait timed out", "rank 1 has not joined it"))
    assert summed(r + 1.0) == 3.0  # the default group goes on
    checks += 1
    say(f"CHECKED rank={r} checks={checks}")
    if r == 0:
        summed(1.0, h)  # rank 1 sleeps: the RuntimeError, uncaught, ends the job
        say("NOT-RAISED rank=0")
    else:
        time.sleep(300)
        say("WOKE rank=1")

elif MODE == "wait":
    dist.init_process_group("aiacc", timeout=datetime.timedelta(minutes=10))
    r = dist.get_rank()
    t = torch.full((3,), r + 1.0)
    if r == 0:
        work = dist.all_reduce(t, async_op=True)
        seen(raises(RuntimeError, lambda: work.wait(timeout=datetime.timedelta(seconds=2)),
                    "Timed out waiting 2000ms for allreduce", "work.wait(timeout=...)",
                    "rank 1 has not joined it (rank 0 did)", "the operation still runs"))
        dist.send(torch.ones(1), 1)
        assert work.wait() and torch.equal(t, torch.full((3,), 3.0)), t
    else:
        dist.recv(torch.ones(1), 0)
        dist.all_reduce(t)
    checks += 1
    assert summed(r + 1.0) == 3.0  # the group is still usable
    checks += 1

elif MODE == "new_group":
    dist.init_process_group("aiacc", timeout=datetime.timedelta(minutes=10))
    r = dist.get_rank()
    assert dist.get_world_size() == 3
    if r == 0:
        seen(raises(RuntimeError, lambda: dist.new_group([0, 2], use_local_synchronization=True, timeout=SHORT),
                    "Timed out waiting 3000ms in new_group(ranks=[0, 2]) on rank 0", "timeout 0:00:03",
                    "rank 2 did not call new_group"))
        dist.send(torch.ones(1), 2)
    elif r == 2:
        dist.recv(torch.ones(1), 0)
        seen(raises(RuntimeError, lambda: dist.new_group([0, 2], use_local_synchronization=True, timeout=SHORT),
                    "new_group(ranks=[0, 2]) on rank 2", "rank 0 did not call new_group",
                    "rank 0 came to it before but gave up"))
    assert summed(r + 1.0) == 6.0  # the default group still works
    checks += 1

else:
    raise SystemExit(f"unknown mode {MODE!r}")

dist.destroy_process_group()
say(f"OK rank={r} checks={checks}")
