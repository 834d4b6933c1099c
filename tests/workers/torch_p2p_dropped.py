"""Point-to-point ``Work`` objects the script drops without waiting, on the ``aiacc`` backend (2 ranks). One mode per
job (``sys.argv[1]``):

``dropped``: rank 0 sends 200 temporaries of 256 KiB each (past MPI's eager limit: MPI reads them while the receiver
takes them) with ``dist.isend(x * 2, 1)`` and drops the Work, with ``dist.send``, ``batch_isend_irecv`` lists it
drops and allocations in between (they reuse freed memory); rank 1 receives each with ``dist.recv`` and gets exactly
what was sent (before: the request and its buffer died with the Work, MPI read freed memory: garbage). The same
messages over gloo (waited for: a dropped gloo send reaches only a receiver already waiting) are the reference.
Rank 1's dropped ``irecv`` into a contiguous and a non-contiguous tensor (staged through a copy; before: MPI wrote
into freed memory, a segfault) lands once rank 0 sends; ``work.is_completed()`` turns true once the message is
there (it stayed false until ``wait()``). The operations still in flight drop back to none once the
peers took them (``p2p.in_flight``), on both ranks: nothing kept for good. Rank 0 drops one more 4 MiB send and
destroys the group at once, before rank 1 receives it: ``destroy_process_group`` waits for it (a peer may still
take it) and rank 1 gets it.

``unmatched``: on a group with ``timeout=3 s``, rank 0 drops a 4 MiB send that rank 1 never receives and an
``irecv`` nobody sends to; ``work.wait(timeout=1 s)`` on a send rank 1 has not received yet raises naming the send,
the peer, the tag and the timeout, and the send still runs (rank 1 takes it later). At ``destroy_process_group``
rank 0 waits at most the group's timeout for the two dropped ones, then warns naming them, and the job ends.

``threads``: rank 1 receives 100 messages into strided tensors while another thread polls each with
``is_completed()`` (which ends it, copying it in); once ``is_success()`` is true, ``wait()`` returns with the message
in the tensor (before: both turned true while the other thread still copied it in: the tensor half filled).

``failing``: rank 0 raises with an ``irecv`` nobody matches in flight and calls ``destroy_process_group`` in a
``finally:``, rank 1 waits in an ``all_reduce``: the job ends at once with rank 0's error and a warning naming the
receive it gave up on (before: ``destroy_process_group`` waited for it up to the group's 30-minute timeout, the job
hung; over gloo, and before dropped works were kept, it ended in seconds).

``exiting``: the same, but rank 0 ends with ``sys.exit(1)`` and never destroys the group: at exit a receive nobody
can read any more is waited for 5 s, then cancelled with a warning naming it, and the job ends (before: the exit
waited for it up to the group's 30-minute timeout, while rank 1 waited for rank 0 in its ``all_reduce``).
"""

import datetime
import gc
import sys
import time

import torch
import torch.distributed as dist

import aiacc.torch  # noqa: F401 - registers the backend
from aiacc.torch import p2p
from report import raises, say

torch.set_num_threads(1)
MODE = sys.argv[1]
N = 200
SIZE = 1 << 16  # float32 elements: 256 KiB, past MPI's eager limit
THREADED = 100  # receives waited for while another thread polls them
checks = 0


def check(ok: bool, what: str) -> None:
    global checks
    assert ok, what
    checks += 1


def message(i: int) -> torch.Tensor:
    return torch.full((SIZE,), float(i)) + torch.arange(SIZE, dtype=torch.float32) % 7


dist.init_process_group("aiacc")
r = dist.get_rank()
assert dist.get_world_size() == 2

if MODE == "dropped":
    gloo = dist.new_group(backend="gloo")
    for group in (gloo, None):
        got = []
        if r == 0:
            for i in range(N):
                if group is gloo:  # (gloo loses a dropped send unless the receiver waits already: waited for)
                    dist.isend(message(i) * 2, 1, group=group).wait()
                elif i % 50 == 7:
                    dist.send(message(i) * 2, 1)
                elif i % 50 == 9:
                    dist.batch_isend_irecv([dist.P2POp(dist.isend, message(i) * 2, 1)])  # the list dropped
                else:
                    dist.isend(message(i) * 2, 1)  # the Work and the tensor dropped at once
                junk = [torch.full((SIZE,), -1.0) for _ in range(3)]  # reuses what was freed
                del junk
                if i % 64 == 0:
                    gc.collect()
        else:
            for i in range(N):
                t = torch.empty(SIZE)
                dist.recv(t, 0, group=group)
                got.append(t)
            if group is gloo:
                reference = got
            else:
                bad = [i for i in range(N) if not torch.equal(got[i], reference[i])]
                check(not bad, f"messages received unlike gloo's (what was sent): {bad[:10]} of {N}")
                check(all(torch.equal(got[i], message(i) * 2) for i in range(N)), "gloo's messages")
        dist.barrier()
    check(p2p.in_flight() == 0, f"operations kept after the peer took them: {p2p.in_flight()}")

    # dropped receives: a contiguous tensor and a strided one (staged through a copy)
    plain, wide = torch.zeros(SIZE), torch.zeros(SIZE, 2)
    if r == 1:
        dist.irecv(plain, 0, tag=1)
        dist.batch_isend_irecv([dist.P2POp(dist.irecv, wide[:, 1], 0, tag=2)])
        gc.collect()
    dist.barrier()
    if r == 0:
        dist.send(message(1), 1, tag=1)
        dist.send(message(2), 1, tag=2)
    else:
        while p2p.in_flight():  # (undefined until it ends, as over gloo; ended by a look at those in flight)
            time.sleep(0.01)
        check(torch.equal(plain, message(1)), "dropped irecv into a contiguous tensor")
        check(torch.equal(wide[:, 1], message(2)) and not wide[:, 0].any(), "dropped irecv into a strided tensor")
    polled = torch.zeros(SIZE, 2)[:, 0]  # (strided: copied in when it ends)
    if r == 0:
        dist.send(message(3), 1, tag=3)
    else:
        work = dist.irecv(polled, 0, tag=3)
        while not work.is_completed():  # (never true before: only wait() ended it)
            time.sleep(0.01)
        check(torch.equal(polled, message(3)), "an irecv polled with is_completed()")
    dist.barrier()
    check(p2p.in_flight() == 0, "operations kept after the receives")

    big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    if r == 0:
        dist.isend(big * 3, 1, tag=4)  # dropped; the group is destroyed before rank 1 receives it
    else:
        time.sleep(1)  # (rank 0 is in destroy_process_group by then, most likely; the check holds either way)
        late = torch.empty_like(big)
        dist.recv(late, 0, tag=4)
        check(torch.equal(late, big * 3), "a dropped send received after its sender destroyed the group")

elif MODE == "unmatched":
    short = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
    big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: it waits for its receiver
    if r == 0:
        work = dist.isend(big, 1, group=short, tag=5)
        say("ERROR-SEEN rank=0: " + raises(RuntimeError, lambda: work.wait(timeout=datetime.timedelta(seconds=1)),
                                           "Timed out waiting 1000ms for send to rank 1, tag 5, on rank 0",
                                           "timeout 0:00:01 (work.wait(timeout=...))", "rank 1 has not received it",
                                           "the operation still runs"))
        checks += 1
        dist.barrier()  # rank 1 receives it after this
        check(work.wait() and p2p.in_flight(short) == 0, "the send waited for again")
        dist.isend(big * 2, 1, group=short, tag=7)  # nobody receives these two
        dist.irecv(torch.zeros(3), 1, group=short, tag=8)
        check(p2p.in_flight(short) == 2, "the dropped operations in flight")
    else:
        dist.barrier()
        late = torch.empty_like(big)
        dist.recv(late, 0, group=short, tag=5)
        check(torch.equal(late, big), "the send whose wait timed out, received later")
    dist.barrier()

elif MODE == "threads":
    # rank 1 waits for receives into strided tensors (staged: copied in when they end) while another thread polls the
    # same works with is_completed(), which may end them first: wait() returned while that thread still copied
    import threading

    current, stop = [None], threading.Event()

    def poll() -> None:
        while not stop.is_set():
            work = current[0]
            if work is not None:
                work.is_completed()

    poller = threading.Thread(target=poll)
    if r == 1:
        poller.start()
    half_filled = []
    for i in range(THREADED):
        if r == 0:
            dist.send(torch.full((1 << 20,), float(i + 1)), 1)
        else:
            wide = torch.zeros(1 << 20, 2)
            work = current[0] = dist.irecv(wide[:, 1], 0)
            while not work.is_success():  # (no look at MPI here: the other thread ends it)
                time.sleep(0)
            work.wait()
            if not bool((wide[:, 1] == i + 1).all()):
                half_filled.append(i)
    if r == 1:
        stop.set()
        poller.join()
        check(not half_filled, f"receives not yet copied in when wait() returned: {len(half_filled)} of {THREADED}")
    check(p2p.in_flight() == 0, "operations kept after the receives")

elif MODE == "failing":
    # rank 0 fails with an irecv nobody will match in flight, destroy_process_group in the script's finally:;
    # rank 1 waits for rank 0 in an all_reduce. The job ends with rank 0's error, at once
    say(f"CHECKED rank={r} checks={checks}")
    try:
        if r == 0:
            work = dist.irecv(torch.zeros(3), 1, tag=9)
            raise ValueError("a bug on rank 0")
        dist.all_reduce(torch.ones(3))
    finally:
        dist.destroy_process_group()

elif MODE == "exiting":
    say(f"CHECKED rank={r} checks={checks}")
    if r == 0:
        work = dist.irecv(torch.zeros(3), 1, tag=9)
        sys.exit(1)
    dist.all_reduce(torch.ones(3))

else:
    raise SystemExit(f"unknown mode {MODE!r}")

say(f"CHECKED rank={r} checks={checks}")
dist.destroy_process_group()
check(not p2p._in_flight, "operations left after destroy_process_group")  # (not looked at: ended by it)
say(f"OK rank={r} checks={checks}")
