"""Point-to-point operations of aiacc's ``torch.distributed`` backend (``send`` / ``recv``, and so ``isend``,
``irecv``, ``batch_isend_irecv``): MPI's requests, waited for under the group's timeout, and kept, with the memory
MPI reads or writes, until MPI is done with them, also when the script drops the ``Work`` without waiting for it.

Dropped works (``dist.isend(x * 2, 1)`` with the returned Work thrown away): the Python object was the only owner of
mpi4py's request and of the buffer it reads, so a send past MPI's eager limit read freed (reused) memory and the
receiver got garbage, and a staged receive (a non-contiguous tensor) wrote into freed memory (a segfault). Now every
operation MPI is not done with is in ``_in_flight`` until it is: a dropped send still reaches its receiver, a dropped
receive still lands in its tensor (as over NCCL; over gloo a dropped send reaches only a receiver already waiting,
and a dropped receive is cancelled). New operations look at those in flight (amortised: when their number doubled)
and end the finished ones, so a script that never waits keeps only what MPI still runs. ``destroy_process_group`` and
the process's exit (``finish``) wait for what is still in flight, up to its group's timeout, so that a peer still
gets a send this rank dropped; past it, receives are cancelled and sends left to MPI, with a warning naming them."""

from __future__ import annotations

import atexit
import collections
import datetime
import logging
import os
import sys
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

import aiacc

from .works import seconds_of

__all__ = ["PointToPoint", "in_flight", "finish", "P2P_SPIN_SECONDS"]

log = logging.getLogger(__name__)
_now = time.perf_counter  # the clock of the works' deadlines (works.py)
P2P_SPIN_SECONDS = 2e-3  # how long a wait for a send / recv looks at it without sleeping between looks
FINISH_QUIET_SECONDS = 5.0  # how long ``finish`` waits for operations in flight before it warns that it waits

# every point-to-point work MPI is not done with, oldest first (MPI reads or writes its memory until then: kept whether
# or not the script keeps the Work); ``_look_at``: how many there may be before a new one looks at them all
_in_flight: "collections.OrderedDict[PointToPoint, None]" = collections.OrderedDict()
_look_at = 16
_left_to_mpi = []  # (request, buffer, tensors) of sends given up on past the group's timeout: kept for good
_exit_hook = []  # (registered at the first operation: nothing at import time)


def in_flight(group=None) -> int:
    """How many point-to-point operations (of ``group``; None: of every group) MPI is not done with, after looking at
    each: those done end now (a staged receive is copied into its tensor)."""
    _look()
    return sum(1 for work in list(_in_flight) if group is None or work._group is group)


def _look() -> None:
    global _look_at
    for work in list(_in_flight):
        work._poll()
    _look_at = max(16, 2 * len(_in_flight))


def finish(group=None, at_exit: bool = False) -> None:
    """``dist.destroy_process_group`` (``group``'s operations) and the process's exit (every group's): wait for the
    operations still in flight, each up to its deadline (the group's timeout from its call), since a peer may still
    receive a send this rank dropped, or send to a dropped receive (both ranks dropped theirs: cancelling one side made
    the other wait); past it, a receive is cancelled (its tensor stays as it was) and a send left to MPI (the peer may
    still receive it while this process runs), with one warning naming them. Called while an exception passes through
    (``destroy_process_group`` in a ``finally:``), it gives them up at once: the job is failing. ``at_exit`` (the
    process ends without having destroyed the group): a receive is waited for FINISH_QUIET_SECONDS at most, then
    cancelled, since nothing can read its tensor any more; only sends, which a peer may still need, wait up to the
    timeout (a script ending with ``sys.exit(1)`` and an ``irecv`` nobody matches held its job for 30 minutes)."""
    works = [work for work in list(_in_flight) if group is None or work._group is group]
    if not works:
        return
    failing = _exception_ending_the_script()
    if failing is None:
        quiet = _now() + FINISH_QUIET_SECONDS

        def deadline(work) -> float:
            return min(quiet, work._deadline) if at_exit and work._kind == "recv" else work._deadline

        works = _still_running(works, lambda work: min(quiet, work._deadline))
        if any(deadline(work) > _now() for work in works):
            log.warning("aiacc backend: rank %d waits, before the process group ends, for %d point-to-point "
                        "operations the script did not wait for (%s), up to the group's timeout counted from each "
                        "call: a peer may still match them", aiacc.rank(), len(works),
                        ", ".join(work._what() for work in works[:8]))
        why = "at exit" if at_exit else "past the group's timeout"
        left = _still_running(works, deadline)
    else:  # (``destroy_process_group`` in a ``finally:`` or ``except:`` the error passes through: the job is failing;
        # waiting up to the timeout held the error, and the job's abort, back for 30 minutes)
        why = f"as a {type(failing).__name__} ends the script"
        left = _still_running(works, lambda work: _now())
    for work in left:
        if work._give_up():
            work._end(RuntimeError(f"aiacc backend: {work._what()} on rank {aiacc.rank()} was given up on when its "
                                   f"process group ended, {why}"))
    if left:
        log.warning("aiacc backend: rank %d gave up, %s, on %d point-to-point operations the script did not wait for "
                    "(%s): receives cancelled, sends left to MPI", aiacc.rank(), why, len(left),
                    ", ".join(work._what() for work in left[:8]))


def _exception_ending_the_script() -> Optional[BaseException]:
    """The exception passing through the caller of ``finish`` on this thread (``destroy_process_group`` in a
    ``finally:`` or an ``except:``), unless it is ``sys.exit(0)``; None when there is none."""
    error = sys.exc_info()[1]
    if isinstance(error, SystemExit) and error.code in (None, 0):
        return None
    return error


def _still_running(works, deadline_of) -> list:
    """``works`` waited for, each up to ``deadline_of(work)``: those done end (in order), the others are returned."""
    for work in works:
        _test_until(work._test, deadline_of(work))
    for work in works:
        work._poll()
    return [work for work in works if not work.is_completed()]


def _test_until(test, deadline: float) -> bool:
    """Whether ``test()`` (an MPI request done) is true by ``deadline`` (``_now()``). MPI has no wait with a deadline:
    it is looked at, yielding the core between looks, for P2P_SPIN_SECONDS (a peer that is there answers within
    microseconds, and ``MPI_Wait`` spun so too), then with sleeps growing to 1 ms between looks."""
    spin = min(_now() + P2P_SPIN_SECONDS, deadline)
    while not test():
        if _now() >= spin:
            break
        os.sched_yield()
    else:
        return True
    nap = 20e-6
    while not test():
        left = deadline - _now()
        if left <= 0:
            return False
        time.sleep(min(nap, left))
        nap = min(nap * 2, 1e-3)
    return True


class PointToPoint(dist._Work):
    """A ``send`` or ``recv`` (``kind``) of the process group ``group`` with the group's rank ``peer``: MPI's
    request (``Isend`` / ``Irecv`` on the group's own communicator) over ``buffer`` (the memory MPI reads or writes:
    kept until MPI is done, with the work, in ``_in_flight``). ``wait()`` ends once it is done (then ``finish()``, the
    copy of a staged receive), or raises RuntimeError once ``work.wait(timeout)``'s timeout, else the group's (counted
    from the call, as a collective's), has passed, naming the operation, the peer, the group and the timeout
    (``MPI_Wait`` waited for ever for a peer that never sends). Past the group's timeout, as after a collective's, the
    group is unusable on this rank (a message that comes late would pair with a later operation) and the work failed:
    a receive is cancelled (``MPI_Cancel``: its tensor stays as it was), a send is left to MPI (its cancel is
    deprecated since MPI 4.0; the receiver may still take it) and kept, with its tensor, for the rest of the job.
    ``work.wait(timeout)`` leaves either running and the group usable: wait again."""

    def __init__(self, request, result, group, kind: str, peer: int, tag: int, finish=None, buffer=None):
        super().__init__()
        self._request = request  # None once ended
        self._buffer = buffer
        self._result = result
        self._group, self._kind, self._peer, self._tag = group, kind, peer, tag
        self._finish = finish
        self._deadline = _now() + group._timeout
        self._error = None
        self._wrong = None  # a receive's message of another size than its tensor (``_test``): its error
        self._status = None
        if kind == "recv":
            from aiacc.transport.mpi import import_mpi  # noqa: PLC0415

            self._status = import_mpi().Status()
        self._future = torch.futures.Future()
        self._driven = False  # a thread waits for it, for its future
        self._lock = threading.Lock()  # one thread at a time looks at MPI's request (MPI's rule), and ends it
        if not _exit_hook:
            _exit_hook.append(atexit.register(finish_all))
        if len(_in_flight) >= _look_at:
            _look()
        _in_flight[self] = None

    def _test(self) -> bool:
        """Whether MPI is done with it (or it ended). Both sides move bytes (``backend._p2p_buffer``): a receive
        whose message has another size than its tensor fails with an error naming both (``_wrong``); with typed
        buffers MPICH ended the whole job on an assertion when a float32 message came into a float64 tensor, and a
        longer message was mpi4py's bare "Message truncated" with the sizes the wrong way round."""
        with self._lock:
            if self._request is None:
                return True
            if self._status is None:
                return self._request.Test()
            try:
                done = self._request.Test(self._status)
            except Exception as e:  # noqa: BLE001 - MPI_ERR_TRUNCATE: a longer message (done); any other is MPI's own
                from mpi4py import MPI  # noqa: PLC0415 - (started by then; imported here, not at aiacc's import)

                if not isinstance(e, MPI.Exception) or e.Get_error_class() != MPI.ERR_TRUNCATE:
                    raise
                self._wrong = self._mismatch(f"more than {len(self._buffer)} bytes")
                return True
            if done and self._status.Get_count() != len(self._buffer):
                self._wrong = self._mismatch(f"{self._status.Get_count()} bytes")
            return done

    def _mismatch(self, came: str) -> ValueError:
        t = self._result[0]
        return ValueError(f"aiacc backend: {self._what()} on rank {aiacc.rank()}: the message has {came}; the tensor "
                          f"it is received into, {str(t.dtype).replace('torch.', '')} of shape {tuple(t.shape)}, has "
                          f"{len(self._buffer)} bytes: send and receive tensors of the same size and dtype")

    def _poll(self) -> None:
        if self._test():
            self._end()

    def _what(self) -> str:
        return f"{self._kind} {'to' if self._kind == 'send' else 'from'} {self._describe_peer()}, tag {self._tag}"

    def _describe_peer(self) -> str:
        ranks = self._group._ranks
        return f"rank {self._peer}" if ranks is None else f"rank {ranks[self._peer]} (rank {self._peer} of the group)"

    def wait(self, timeout=None) -> bool:
        if self._request is not None:
            given = None if timeout is None else seconds_of(timeout)
            if not _test_until(self._test, self._deadline if given is None else _now() + given):
                self._timed_out(given)
            self._end()
        if self._error is not None:
            raise self._error
        return True

    def _end(self, error: Optional[BaseException] = None) -> None:
        with self._lock:
            if self._request is None:  # (ended already, on another thread or by a look at those in flight)
                return
            # a staged receive is copied in before ``_request`` turns None, under the lock: a thread whose wait() or
            # is_completed() sees it ended (or waits here for the lock) sees the tensor filled. (The copy ran after
            # the lock: a wait() on one thread returned while another thread's look copied, the tensor half filled.)
            finish, self._finish = self._finish, None
            error = error or self._wrong
            if error is None and finish is not None:
                finish()
            self._error = error
            _in_flight.pop(self, None)
            self._request = self._buffer = None
        if error is not None:
            self._future.set_exception(error)
        else:
            self._future.set_result(self._result)

    def _give_up(self) -> bool:
        """Past the group's timeout: a receive is cancelled (False where its message came meanwhile: it ended), a send
        left to MPI, kept with its memory for good. True when given up on."""
        with self._lock:
            request = self._request
            if request is None:
                return False
            if self._kind == "send":
                _left_to_mpi.append((request, self._buffer, self._result))  # (MPI may still read it)
            else:
                from aiacc.transport.mpi import import_mpi  # noqa: PLC0415

                status = import_mpi().Status()
                request.Cancel()
                request.Wait(status)
                if not status.Is_cancelled():
                    request = None  # (its message came meanwhile: it ends as done)
        if request is None:
            self._end()
            return False
        return True

    def _timed_out(self, given: Optional[float]) -> None:
        """Raise the error of a wait past ``given`` (``work.wait(timeout)``'s) or the group's timeout; nothing when
        the operation ended meanwhile (a receive that could not be cancelled had its message)."""
        group = self._group
        seconds = given or group._timeout
        if given is None and not self._give_up():
            return
        peer = self._describe_peer()
        text = (f"aiacc backend: Timed out waiting {round(seconds * 1000)}ms for {self._kind} "
                f"{'to' if self._kind == 'send' else 'from'} {peer}, tag {self._tag}, on rank {aiacc.rank()} "
                f"of {group._describe()}, timeout {datetime.timedelta(seconds=seconds)} "
                f"({'work.wait(timeout=...)' if given is not None else 'the timeout of the process group'}): ")
        text += (f"{peer} has not received it" if self._kind == "send" else f"no message from {peer} came")
        if given is not None:  # (MPI still reads or writes its tensor: it stays in flight)
            raise RuntimeError(text + "; the operation still runs: wait for it again, or end the job")
        text += ("; the send is left to MPI (cancelling a send is deprecated since MPI 4.0): the peer may still "
                 "receive it" if self._kind == "send" else "; the receive was cancelled: the tensor stays as it was")
        error = RuntimeError(group.unusable_after(text))
        self._end(error)
        raise error

    def is_completed(self) -> bool:
        """Whether MPI is done with it (it ends now if so: a script polling this never waited otherwise)."""
        self._poll()
        return self._request is None

    def is_success(self) -> bool:
        return self._request is None and self._error is None

    def exception(self):
        return self._error

    def result(self):
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        """Completed by a thread of its own that waits for the operation (past the group's timeout, failed with
        that error). Nothing drove it but wait() and is_completed(): a future waited for hung past the timeout."""
        with self._lock:
            start, self._driven = self._request is not None and not self._driven, True
        if start:
            threading.Thread(target=self._drive, name="aiacc-p2p-future", daemon=True).start()
        return self._future

    def _drive(self) -> None:
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - the future has the error (``_end``)
            pass


def finish_all() -> None:
    """At exit (registered at the first point-to-point operation, so before aiacc's shutdown and MPI's end): every
    group's operations in flight (``finish``); none once MPI has ended (a script that finalized it itself)."""
    from mpi4py import MPI  # noqa: PLC0415 - started by then: there are operations

    if _in_flight and not MPI.Is_finalized():
        finish(None, at_exit=True)
