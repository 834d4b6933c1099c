"""The ``Work`` objects of aiacc's ``torch.distributed`` backend (``backend.py``): what a collective of the process
group returns, how its future completes (on a thread of its own, with errors that torch's C++ sees), and how
long it is kept alive for torch's C++, which may wait on it after Python dropped it."""

from __future__ import annotations

import collections
import datetime
import queue
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["Work", "DoneWork", "Chain", "UNWAITED_KEPT", "seconds_of"]

_now = time.perf_counter  # the clock of the engine's handles' deadlines (aiacc/requests.py): one for all deadlines


def seconds_of(timeout) -> Optional[float]:
    """A timeout torch passes (a ``timedelta``; from its C++, ``kNoTimeout`` is 0 and an unset option's is
    negative) in seconds; None where it sets none."""
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        return None
    return seconds if seconds > 0 else None


class _Completions:
    """The thread that completes the futures of the group's works, in the order the engine finishes them.

    Not the engine's thread: a future's callbacks run where it is completed, and a callback may start
    another collective and wait for it (torch's PowerSGD hook does), which only a free engine thread can
    run (on the engine's thread that waited forever). A future asked for inside such a callback completes
    on the engine's thread itself (this thread is the one waiting for it)."""

    def __init__(self):
        self._queue = queue.SimpleQueue()
        self._thread = None
        self._lock = threading.Lock()

    def on_this_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def put(self, fn, arg) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="aiacc-c10d-futures", daemon=True)
                    self._thread.start()
        self._queue.put((fn, arg))

    def _run(self) -> None:
        while True:
            fn, arg = self._queue.get()
            fn(arg)


_completions = _Completions()


class _Watchdog:
    """Fails the future of a Work not done within its timeout (the group's, or the operation's): DDP and
    other users of futures wait on them in torch's C++, which no ``Work.wait`` timeout reaches (over gloo the
    collective itself fails after the group's timeout). One thread, asleep on a condition until the nearest
    deadline. Works are kept in one queue per timeout, in the order of their deadlines, and leave it when done."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._queues = {}  # seconds -> {work: deadline}, oldest first
        self._thread = None
        self._until = None  # when the thread wakes next (None: when notified): it sleeps until then

    def watch(self, work, seconds: float, deadline: float) -> None:
        with self._cond:
            queue_ = self._queues.setdefault(seconds, collections.OrderedDict())
            queue_[work] = deadline
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="aiacc-c10d-timeouts", daemon=True)
                self._thread.start()
            if self._until is None or deadline < self._until:
                # (only then: a thread woken per operation took the GIL from training for nothing; it wakes at
                # an earlier deadline anyway, done or not, and looks again)
                self._cond.notify()

    def forget(self, work, seconds: float) -> None:
        with self._cond:
            queue_ = self._queues.get(seconds)
            if queue_:
                queue_.pop(work, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    now, due, nearest = _now(), None, None
                    for queue_ in self._queues.values():
                        if queue_:
                            work, deadline = next(iter(queue_.items()))
                            if deadline <= now:
                                due = work
                                del queue_[work]
                                break
                            nearest = deadline if nearest is None else min(nearest, deadline)
                    if due is not None:
                        break
                    # (a deadline passed while done, forgotten: kept as the wake-up time, so that the next watch
                    # with a later deadline need not notify)
                    if nearest is not None or self._until is None or self._until <= now:
                        self._until = nearest
                    self._cond.wait(None if self._until is None else self._until - now)
            due._expire()


_watchdog = _Watchdog()
# Works not waited for yet whose future nobody took: a Work made in Python is a C++ object whose wait() is
# this class's only while its Python object lives, and torch's C++ may keep one and wait later (DDP under
# Join keeps the forward pass's allreduce and waits in backward: it waited forever on the base class)
# Bounded: past UNWAITED_KEPT of them, the oldest finished ones go (a script that never waits for its async
# Works kept every one, with its tensors, for good: 290 KiB a step of 256 KiB all_reduces, where gloo frees them).
_unwaited: "collections.OrderedDict[Work, None]" = collections.OrderedDict()
UNWAITED_KEPT = 256
_ABSENT = object()
# ... and the last works waited for: torch's C++ may ask one for its future right after waiting (DDP's reducer
# reads the Join allreduce's result that way), which needs the Python object still
_waited = collections.deque(maxlen=64)


def _release_finished() -> None:
    """Forget the oldest finished unwaited Works beyond the newest UNWAITED_KEPT (torch's C++ waits on
    recent ones: DDP on this iteration's), so that a script that never waits does not keep them all."""
    for work in list(_unwaited)[:len(_unwaited) - UNWAITED_KEPT]:
        if work._handle.done():
            _unwaited.pop(work, None)


def finish_group(group) -> None:
    """``dist.destroy_process_group`` of ``group``: its collectives still in flight end first (results written into
    their tensors), as over gloo. (One over all ranks, never waited for, ran later on the job's engine, reading and
    writing the script's tensor after the group was gone: a buffer reused meanwhile was overwritten.) An error is
    left to the operation's own wait."""
    for work in [w for w in list(_unwaited) if w._group is group]:
        try:
            work._run_finish(work._deadline)
        except Exception:  # noqa: BLE001, S110 - its wait raises it (a timeout in the group's words)
            pass


class _Failed:
    """An error on its way through a Work's future. torch's ``Future.set_exception`` completes the C++ future
    *successfully*, with the exception as its value (DDP's reducer then took it for its tensors: a segfault
    when a rank's engine stopped); raised in a ``then`` callback (``_value_or_raise``) it fails the C++ future,
    and every reader gets the error."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


def _value_or_raise(future):
    value = future.value()
    if value.__class__ is _Failed:
        raise value.error
    return value


class Work(dist._Work):
    """One operation of the process group. ``wait()`` blocks until the engine has done it (and raises
    its error). The future is made when asked for (a synchronous call never pays for one) and completes
    on the group's completion thread with ``result`` (DDP chains its bucket handling onto it). Kept
    alive until waited for or its future completes. ``group``: the process group, whose timeout a wait
    without one of its own lasts (``timeout``: the operation's own, torch's ``opts.timeout``), and which
    words the error of a wait past it."""

    def __init__(self, handle, result, finish=None, group=None, timeout: Optional[float] = None):
        super().__init__()
        self._group = group
        # the timeout of a wait without one of its own: the operation's, else the group's, from now
        self._timeout = timeout or (group._timeout if group is not None else None)
        # (``time.perf_counter``, the engine handles' clock: a wait passes the deadline on as it is)
        self._deadline = None if self._timeout is None else _now() + self._timeout
        self._settled = False  # the future has its value (or error)
        self._handle = handle
        self._result = result
        self._finish = finish
        self._error = None  # the operation's error, once is_completed() saw it
        self._finish_error = None  # the error of ``finish``, raised to every later caller too
        self._lock = threading.Lock()
        self._future = self._raw = None
        _unwaited[self] = None
        if len(_unwaited) > UNWAITED_KEPT:
            _release_finished()

    def _run_finish(self, deadline: Optional[float] = None):
        """Wait for the engine, then run the backend's ``finish`` once (it lands the result and checks what
        arrived: sizes, splits); its error is raised to every caller after the first too (the future, a poll, a
        second wait: each got the result unwritten, no error, where the first caller was the future's)."""
        self._handle.wait(deadline)  # (TimeoutError once ``deadline`` passed)
        if self._finish is not None:  # (set once, cleared once: only then the lock)
            with self._lock:
                if self._finish is not None:
                    finish, self._finish = self._finish, None
                    try:
                        finish()
                    except BaseException as exc:
                        self._finish_error = exc
                        raise
        if self._finish_error is not None:
            raise self._finish_error

    def _complete(self, _core) -> None:  # the completion thread (or the engine's, or at once when done already)
        _unwaited.pop(self, None)
        if self._deadline is not None:
            _watchdog.forget(self, self._timeout)
        try:
            self._run_finish()
            value = self._result
        except BaseException as exc:  # noqa: BLE001 - whoever waits on the future gets it
            value = _Failed(exc)
        self._settle(value)

    def _settle(self, value) -> None:
        with self._lock:
            if self._settled:  # (the watchdog failed it: its timeout passed first)
                return
            self._settled = True
        self._raw.set_result(value)

    def _expire(self) -> None:
        """The watchdog's: the timeout passed with the operation not done: its future fails with the error of a
        wait past the group's timeout (which makes the group unusable)."""
        core = self._handle._core
        error = None if core.done() else self._group.timed_out(core.name, self._timeout, False, core.done)
        if error is not None:
            self._settle(_Failed(error))

    def wait(self, timeout=None) -> bool:
        """Block until done, or raise RuntimeError once ``timeout`` (a ``timedelta``; none: the operation's, else
        the group's) has passed, naming the operation, the group, the timeout and the ranks that have not
        joined it (``AiaccProcessGroup.timed_out``). The engine's handle is waited for on a condition with a
        deadline (or its cycles run on this thread, up to the deadline)."""
        try:
            given = None if timeout is None else seconds_of(timeout)
            try:  # (the operation's or the group's timeout counts from the operation's start, as over gloo)
                self._run_finish(self._deadline if given is None else _now() + given)
            except TimeoutError:
                self._timed_out(given)
                self._run_finish()  # (it ended just now)
        finally:
            if _unwaited.pop(self, _ABSENT) is not _ABSENT:  # (one step: the completion thread pops too)
                _waited.append(self)
        return True

    def _timed_out(self, given: Optional[float]) -> None:
        """A wait past its deadline: raises the error of ``work.wait(timeout)`` (``given``) or of the operation's (or
        group's) timeout, unless the operation ended meanwhile."""
        core = self._handle._core
        seconds = given or self._timeout
        if self._group is None and not core.done():
            raise RuntimeError(f"aiacc backend: Timed out waiting {round(seconds * 1000)}ms for operation "
                               f"{core.name!r}") from None
        error = None if core.done() else self._group.timed_out(core.name, seconds, given is not None, core.done)
        if error is not None:  # (else it ended just now)
            raise error from None

    def is_completed(self) -> bool:
        """Done, with the outputs filled (copied where the engine could not write them in place: a list of
        tensors, a strided one), as over gloo: it said done with them still unwritten."""
        if not self._handle.done():
            return False
        if self._error is None:  # (the handle's own finish too: a strided tensor's copy back)
            try:
                self._run_finish()
            except Exception as exc:  # noqa: BLE001 - the operation's error: exception() gives it, wait() raises it
                self._error = exc
        return True

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self):
        return self._error if self.is_completed() else None

    def result(self):
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            if self._future is None:
                self._raw = torch.futures.Future()
                self._future = self._raw.then(_value_or_raise)
                make = True
            else:
                make = False
        if make:
            if self._deadline is not None and not self._handle.done() and self._group is not None:
                _watchdog.watch(self, self._timeout, self._deadline)
            if self._handle.done() or _completions.on_this_thread():
                # done already: complete it here (torch reads the value right after asking); asked for inside a
                # future's callback, which waits for it: on the engine's thread
                self._handle._core.add_done_callback(self._complete)
            else:
                self._handle._core.add_done_callback(lambda core: _completions.put(self._complete, core))
        return self._future

    def synchronize(self) -> None:
        self.wait()


class DoneWork(dist._Work):
    """An operation that had nothing to do (an all_to_all of empty lists)."""

    def __init__(self, result):
        super().__init__()
        self._result = result
        self._future = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def result(self):
        return self._result

    def get_future(self) -> torch.futures.Future:
        return self._future


class Chain(dist._Work):
    """Several works that finish together (coalesced calls)."""

    def __init__(self, works, result):
        super().__init__()
        self._works = works
        self._result = result
        self._future = torch.futures.collect_all([w.get_future() for w in works]).then(lambda _: result)

    def wait(self, timeout=None) -> bool:
        given = seconds_of(timeout)
        deadline = None if given is None else _now() + given
        for w in self._works:
            w.wait(None if deadline is None else datetime.timedelta(seconds=max(deadline - _now(), 1e-3)))
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self):
        return self._future
