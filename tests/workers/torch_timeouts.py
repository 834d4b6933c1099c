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

``p2p`` (2 ranks): groups over both ranks made with ``timeout=3 s``. Rank 0's ``recv`` from rank 1, which never
sends, raises RuntimeError naming recv, rank 1, the group and the timeout, its tensor untouched (the receive is
cancelled), and the group is unusable after it; its ``send`` of 4 MiB (past MPI's eager limit: it waits for the
receiver) on the other group, which rank 1 does not receive yet, raises naming send and rank 1; ``work.wait(timeout=
2 s)`` on an ``irecv`` raises and the receive still runs: once rank 1 sends, ``work.wait()`` has the tensor. Rank 1
then receives the send rank 0 gave up on (it was left to MPI). Before, each waited for ever.

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

elif MODE == "p2p":
    dist.init_process_group("aiacc", timeout=datetime.timedelta(minutes=10))
    r = dist.get_rank()
    f = dist.new_group([0, 1], timeout=SHORT)
    h = dist.new_group([0, 1], timeout=SHORT)
    big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    for group in (None, f, h):  # every group carries messages while both ranks take part
        got = torch.zeros(3)
        if r == 0:
            dist.send(torch.full((3,), 7.0), 1, group=group)
        else:
            dist.recv(got, 0, group=group)
            assert torch.equal(got, torch.full((3,), 7.0)), got
        checks += 1
    if r == 0:
        got = torch.zeros(3)
        seen(raises(RuntimeError, lambda: dist.recv(got, 1, group=f), "Timed out waiting 3000ms for recv from rank 1, "
                    "tag 0, on rank 0 of the process group", "of ranks [0, 1], timeout 0:00:03 (the timeout of the "
                    "process group): no message from rank 1 came", "the receive was cancelled", "unusable from now on"))
        assert torch.equal(got, torch.zeros(3)), got
        seen(raises(RuntimeError, lambda: dist.send(got, 1, group=f), "send on the process group",
                    "unusable since an earlier wait timed out", "for recv from rank 1"))
        seen(raises(RuntimeError, lambda: dist.send(big, 1, group=h), "Timed out waiting 3000ms for send to rank 1",
                    "timeout 0:00:03", "rank 1 has not received it", "the peer may still receive it",
                    "unusable from now on"))
        work = dist.irecv(got, 1)  # the default group: its timeout is 10 min
        seen(raises(RuntimeError, lambda: work.wait(timeout=datetime.timedelta(seconds=2)),
                    "Timed out waiting 2000ms for recv from rank 1", "(work.wait(timeout=...)): no message from rank 1",
                    "the operation still runs"))
        dist.barrier()  # rank 1 sends after it
        assert work.wait() and torch.equal(got, torch.full((3,), 5.0)), got
    else:
        dist.barrier()  # rank 0's waits have timed out
        late = torch.zeros_like(big)
        dist.recv(late, 0, group=h)  # the send rank 0 gave up on, left to MPI
        assert torch.equal(late, big)
        dist.send(torch.full((3,), 5.0), 0)
    checks += 1
    # a send's or receive's future waited for ends by itself: with the tensor, or past the group's timeout with its
    # error (nothing drove it but wait() and is_completed(): it hung for ever)
    g = dist.new_group([0, 1], timeout=SHORT)
    x = torch.full((3,), 9.0) if r == 0 else torch.zeros(3)
    work = dist.isend(x, 1) if r == 0 else dist.irecv(x, 0)
    assert torch.equal(work.get_future().wait()[0], torch.full((3,), 9.0)), x
    checks += 1
    if r == 0:
        seen(raises(RuntimeError, lambda: dist.irecv(torch.zeros(3), 1, group=g).get_future().wait(),
                    "Timed out waiting 3000ms for recv from rank 1", "no message from rank 1 came"))
    dist.barrier()
    assert summed(r + 1.0) == 3.0  # the default group still works
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
