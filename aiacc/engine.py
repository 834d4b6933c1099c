"""The engine: lifecycle, ``submit() -> Handle``, and the cycle loop of the background thread.

One thread owns all communication. Each cycle (every ``cycle_time_ms``)::

    drain submissions ─► negotiate (one bitwise AND; gather only for new names)
          ─► schedule (priority queue, partitions, credit) ─► execute (fuse, reduce, complete)
          (tensors agreed through the cache: bucketed straight from their cache entries)

The work is split into units with one job each: ``requests`` builds and
validates what is submitted, ``negotiation`` agrees on it, ``scheduler``
orders it, ``execution`` runs buckets and collectives with its buffers and
plans, ``stall`` names the ranks a tensor waits for. This module wires them
together and owns the thread.

The training thread only submits and waits; copies and MPI calls release the
GIL, so the training thread keeps computing while the engine communicates.

Errors never hang: a mismatch becomes the same error on every rank; a stall
is reported (and, if configured, ends every rank); an unexpected failure of
the engine thread, or an exception nobody caught on any rank, aborts the
whole MPI job with the message printed.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from . import devices
from .config import Config
from .exceptions import AiaccError, ConfigError, DuplicateNameError, InvalidArgumentError, ShutdownError
from .execution import Executor
from .fusion import plan as plan_buckets
from .fusion import PlanCache
from .negotiation import JOIN_NAME, Negotiator
from .ops import Collective, ReduceOp
from .requests import Handle, Request, RequestFactory, Waker, as_priority, finish_allreduces
from .scheduler import Scheduler
from .stall import StallInspector
from .timeline import DYNAMIC_TIMELINE, PACK, QUEUE, UNPACK, Timeline, negotiate_phase, op_phase
from .transport.mpi import MPITransport, import_mpi
from .transport.shm import SharedAllreduce, shared_window_room

logger = logging.getLogger("aiacc")

__all__ = ["Engine", "Handle", "Request"]

_ALLREDUCE = Collective.ALLREDUCE
_NDARRAY = np.ndarray
# settings that shape every rank's collectives alike (fusion, the response cache's bits, hosts and hierarchy, the
# shared-memory window, credit, the autotuner's steps; the order of the queue (priority), the split of large
# tensors (partitions) and overlap_forward's waits): the ranks must be given the same values. (The bucket cap
# may differ: the first step of a set of buckets takes rank 0's.)
MUST_AGREE = ("fusion_threshold", "cache_capacity", "hosts_per_node", "hierarchical_allreduce", "shm_bytes",
              "credit_bytes", "autotune", "autotune_warmup_steps", "autotune_steps_per_sample", "priority",
              "partition_bytes", "overlap_forward", "dynamic_process_sets", "check_same_start")
# seconds: the pause of an idle engine (a shutdown or stall check asked by another rank waits this long)
MAX_IDLE_SLEEP = 0.5

# With a credit, allreduces posted in one cycle fly while later cycles negotiate. A rank can take
# more in flight while fewer than this many posting cycles of it are unfinished; all ranks post
# only when every rank can (a bit of the negotiation), so their collectives stay in the same order.
PIPELINE_DEPTH = 2

# Ctrl-C while the main thread runs a cycle (waiting for a handle, it runs the engine's cycles itself):
# a KeyboardInterrupt there would leave the other ranks in a collective this rank abandoned half way, so
# aiacc's handler of SIGINT (installed by init() in place of Python's default one) only notes it, and the
# KeyboardInterrupt is raised once the cycle is over, from the wait, as it is when the engine's thread
# runs the cycles: the script's own `except KeyboardInterrupt` runs, and the other ranks get a
# ShutdownError naming this rank when it exits. [running a cycle on the main thread, interrupted since]
_MAIN_CYCLE = [False, False]


def _on_sigint(signum, frame) -> None:
    if _MAIN_CYCLE[0] and not _MAIN_CYCLE[1]:  # (a second Ctrl-C in the same cycle, one that hangs: at once)
        _MAIN_CYCLE[1] = True
        return
    signal.default_int_handler(signum, frame)


def defer_interrupts(install: bool) -> None:
    """Put aiacc's SIGINT handler in place of Python's default one (``install``), or back; nothing
    when the script has a handler of its own, or off the main thread (where signals cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGINT)
    if install and current is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
    elif not install and current is _on_sigint:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# what summary() counts besides allreduces (Executor._run_single's counters, one per collective run)
_OTHER_KINDS = ("broadcast", "allgather", "alltoall", "reducescatter", "barrier", "join", "adasum")


def _same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one file (through a symlink or a hard link too)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # (one of them does not exist)
        return False


class Engine:
    """The communication engine of one process. Create through ``aiacc.init()``.

    ``config`` is what the job started with; the settings the autotuner changes live in
    ``fusion_threshold``, ``cycle_time`` and the scheduler, and change only through :meth:`tune`.
    """

    def __init__(self, config: Config, comm=None, job_ranks: Optional[Sequence[int]] = None, spare_comm: bool = False):
        """``job_ranks``: a process set's engine runs on ``comm``, a communicator of the set's ranks;
        these are their ranks in the job, which errors and stall reports name. ``spare_comm``: also make
        ``self.spare_comm``, a duplicate of the base communicator for the caller (the process-set table), before
        the engine thread starts: MPI started by a script at a level below MPI_THREAD_MULTIPLE must not be
        called from two threads at once (a Dup beside the thread's first collective failed in MPICH)."""
        MPI = import_mpi(config.start_timeout)
        self.config = config
        base = MPI.COMM_WORLD if comm is None else comm
        self.base_comm = base  # what the job runs on (process sets split from it)
        self.comm = base.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.mpi_thread_multiple = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self._agree_on_settings()
        self._init_topology(MPI)
        self.job_ranks = list(job_ranks) if job_ranks is not None else None
        self.job_rank = self.job_ranks[self.rank] if self.job_ranks is not None else self.rank  # (what messages say)
        self.stall = StallInspector(self.rank, config.stall_check_seconds, config.stall_shutdown_seconds, self.job_rank,
                                     config.variable("stall_shutdown_seconds"),
                                     "" if self.job_ranks is None else f" in the process set of ranks {self.job_ranks}")
        self.transport = MPITransport(self.comm, on_slow_wait=self._on_slow_wait)
        self.transport.set_hosts(self.local_comm, self.cross_comm, self.uniform_hosts)
        self.negotiator = Negotiator(self.rank, self.size, self.transport, config.cache_capacity)
        self.negotiator.job_ranks = self.job_ranks
        self._shutdown_reason: Optional[str] = None
        self.scheduler = Scheduler(config.priority, config.partition_bytes, config.credit_bytes)
        self._nccl = None
        self.fusion_threshold = config.fusion_threshold
        self.cycle_time = config.cycle_time_ms / 1000.0
        self.timeline: Optional[Timeline] = None
        self.mark_cycles = config.timeline_mark_cycles
        problem = None  # a file this rank could not open: raised on every rank once all have got this far
        if config.timeline and config.timeline != DYNAMIC_TIMELINE:
            try:
                self.timeline = self._open_timeline(config.timeline)
            except OSError as exc:
                problem = f"{config.variable('timeline')}={config.timeline!r}: cannot write the timeline ({exc})"
        self.stats = collections.Counter()
        # Hierarchical allreduce pays off only with several hosts of several ranks each.
        hierarchy = (self.local_comm, self.cross_comm) if config.hierarchical_allreduce and self.size > 1 else None
        self.executor = Executor(self.rank, self.size, self.transport, self.transport_for, self._complete, self.stats,
                                 self.timeline, hierarchy, self._complete_all)
        self._shared_window(config)
        self._queue: collections.deque = collections.deque()
        self._wake = threading.Event()  # ends the pause between cycles
        self._urgent = threading.Event()  # someone waits for a handle: no gathering, cycle now
        self._waker = Waker(self._urgent, self._wake)
        waker = self._waker
        self.transport.hurry = lambda: waker.waiters > 0
        self.requests = RequestFactory(self.rank, self.size, self._waker)
        self._idle = False  # set by the engine thread before an idle pause longer than a cycle
        self._inflight: dict = {}  # name -> request, from submit to completion
        self._plans = PlanCache()  # bucket layouts of the cycles agreed through the response cache
        self._lock = threading.Lock()
        # held while a cycle runs: by the engine thread, or by a thread waiting for a handle (_help)
        self._cycle_lock = threading.Lock()
        self._helpers = 0  # threads in _help
        self._helper_cycles = False  # a waiting thread holds the cycle lock, running cycles
        self._waker.helper = self._help if config.caller_cycles else None
        self._shutdown_requested = False
        # stall reports asked for by threads whose wait timed out (``missing_ranks``): the number of such threads,
        # the last report and how many reports there have been, under the condition the askers wait on
        self._reports = threading.Condition(threading.Lock())
        self._report_wanted = 0
        self._report: list = []
        self._report_no = 0
        self._closed = False  # no more submits
        self._stop_error: Optional[AiaccError] = None
        self.autotuner = None
        if config.autotune and problem is None:
            from .autotune import Autotuner  # noqa: PLC0415

            try:
                self.autotuner = Autotuner(self, config)
            except OSError as exc:
                problem = f"{config.variable('autotune_log')}={config.autotune_log!r}: cannot write the autotune log ({exc})"
        self._agree_on_files(problem)
        self.spare_comm = base.Dup() if spare_comm else None
        self._final_cpu = float("nan")  # the engine thread's CPU seconds, once it has ended
        self._thread = threading.Thread(target=self._run, name="aiacc-engine", daemon=True)
        self._thread.start()

    def _agree_on_settings(self) -> None:
        """Raise the same ConfigError on every rank, naming the variable and each rank's value, when the ranks
        were given different values of a setting that shapes their collectives (``MUST_AGREE``): each rank
        would fuse, cache, split hosts or share memory its own way, and the job hung or MPI failed. The first
        collective of the engine: ``hosts_per_node`` decides which ones come next."""
        from .autotune import KNOBS  # noqa: PLC0415 - (as the Autotuner: loaded when needed)

        config = self.config
        mine = tuple(getattr(config, f) for f in MUST_AGREE)
        named = {f: config.variable(f) for f in MUST_AGREE if f in config.explicit}
        everyone = self.comm.allgather((mine, named, sorted(config.explicit & set(KNOBS))))
        # the autotuner's knobs that some rank was given (a cycle time set on one rank only): held constant on
        # every rank, whose autotuners otherwise tuned different knobs and waited for each other for ever
        self.fixed_knobs = frozenset().union(*(fixed for _, _, fixed in everyone))
        for i, field in enumerate(MUST_AGREE):
            by_value: dict = {}
            for r, (values, _, _) in enumerate(everyone):
                by_value.setdefault(values[i], []).append(r)
            if len(by_value) > 1:
                names = sorted({n[field] for _, n, _ in everyone if field in n}) or [config.variable(field)]
                # (a value no rank of its group set is marked: it read as if that rank had been given it)
                detail = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {value!r}"
                                   + ("" if any(field in everyone[r][1] for r in rs) else " (the default)")
                                   for value, rs in by_value.items())
                self.comm.Free()
                raise ConfigError(f"aiacc cannot start: the ranks were given different values of {' / '.join(names)} "
                                  f"({detail}); every rank needs the same value")

    def _agree_on_files(self, problem: Optional[str]) -> None:
        """Raise the same ConfigError on every rank if some rank could not open a file it writes (the
        timeline, the autotune log: rank 0's only, by default): that rank alone failing would leave the
        others waiting for it in the engine's first collective for ever."""
        problems = self.comm.allgather(problem)
        if any(problems):
            if self.timeline is not None:
                self.timeline.close()
            self.comm.Free()
            detail = "; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p)
            raise ConfigError(f"aiacc cannot start: {detail}")

    def _init_topology(self, MPI) -> None:
        per_host = self.config.hosts_per_node
        if per_host > 0:  # emulated hosts: consecutive ranks
            self.local_comm = self.comm.Split(self.rank // per_host, self.rank)
        else:
            self.local_comm = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = self.local_comm.Get_rank()
        self.local_size = self.local_comm.Get_size()
        self.cross_comm = self.comm.Split(self.local_rank, self.rank)
        self.cross_rank = self.cross_comm.Get_rank()
        self.cross_size = self.cross_comm.Get_size()
        sizes = self.comm.allgather(self.local_size)
        self.uniform_hosts = min(sizes) == max(sizes)

    def _shared_window(self, config: Config) -> None:
        """A one-host job reduces its fusion buffers through shared memory (``transport.shm``), not with
        emulated hosts (their ranks stand for separate machines). Every rank decides alike (the window
        is made collectively): no rank where /dev/shm lacks the room."""
        slot = config.shm_bytes
        if slot <= 0 or self.size < 2 or self.local_size != self.size or config.hosts_per_node > 0:
            return
        room = shared_window_room((self.size + 1) * slot)
        if not self.comm.allreduce(room, op=import_mpi().LAND):
            logger.info("aiacc: /dev/shm has no room for %d bytes of shared window on some rank; fusion buffers "
                        "are reduced by MPI", (self.size + 1) * slot)
            return
        shared, error = None, None
        try:
            shared = SharedAllreduce(self.local_comm, slot, self.transport.wait_politely,
                                     lambda: self._waker.waiters > 0)
        except Exception as exc:  # noqa: BLE001 - an MPI without shared windows: MPI reduces everything
            error = exc
        # every rank or none: a rank without the window would meet the others' barriers with MPI's allreduce
        if self.comm.allreduce(shared is not None, op=import_mpi().LAND):
            self.executor.shared = shared
        elif error is not None:
            logger.warning("aiacc: no shared-memory window on rank %d (%r); fusion buffers are reduced by MPI",
                           self.job_rank, error)
        # (a window made on some ranks only is left unfreed: freeing it is collective)

    @property
    def closed(self) -> bool:
        """True once this engine takes no more submits (shut down, or stopped by an error)."""
        return self._closed

    def tune(self, fusion_threshold: int, cycle_time_ms: float, partition_bytes: int) -> None:
        """Change the tunable settings (the autotuner's only way in; engine thread only)."""
        self.fusion_threshold = int(fusion_threshold)
        self.cycle_time = float(cycle_time_ms) / 1000.0
        self.scheduler.partition_bytes = int(partition_bytes)

    # ---- submission (any thread) ---------------------------------------------------
    def submit(
        self,
        kind: Collective,
        arrays,
        *,
        name: Optional[str] = None,
        op=ReduceOp.AVERAGE,
        root: int = 0,
        prescale: float = 1.0,
        postscale: float = 1.0,
        compression=None,
        priority: float = 0.0,
        outputs: Optional[Sequence[np.ndarray]] = None,
        splits=None,
        allocate: Optional[Callable] = None,
        labels: Tuple[str, ...] = (),
    ) -> Handle:
        """Queue one operation; returns at once with a :class:`Handle`.

        ``labels``: the names of the tensors that ``arrays`` (one flat buffer, a gradient bucket)
        already fuses: it is reduced where it lies, never copied into another fusion buffer."""
        if self._closed:
            what = f"{Collective(kind)} of tensor {name!r}" if name is not None else f"{Collective(kind)}"  # (barrier)
            err = ShutdownError(f"cannot submit {what}: "
                                f"{self._stop_error or 'aiacc has been shut down'}")
            err.engines_stopped = getattr(self._stop_error, "engines_stopped", False)
            raise err
        if kind is _ALLREDUCE and name.__class__ is str and arrays.__class__ is _NDARRAY and not labels:
            return self.submit_allreduce(arrays, name, op, prescale, postscale, compression, priority, outputs,
                                         allocate)  # the common case
        req = self.requests.make(kind, arrays, name, op, root, prescale, postscale, compression, priority,
                                 outputs, splits, allocate, labels)
        return self._enqueue(req.name, req)

    def _enqueue(self, name: str, req: Request, wake: bool = True) -> Request:
        """Queue ``req`` for the next cycle, once no operation of the same name is in flight. ``wake``
        False: the caller waits for it next, and runs the cycle itself (``_help``); waking the idle
        engine thread as well only has it take the GIL and a core in the middle of that cycle (measured:
        a synchronous 16 MiB ``allreduce_`` 0.92 -> 0.94 of raw MPI without the wake-up)."""
        inflight = self._inflight
        if inflight.setdefault(name, req) is not req:  # (one atomic step: no lock needed)
            if name == JOIN_NAME:
                raise DuplicateNameError(f"join() was called on rank {self.job_rank} while an earlier join() of this "
                                         "rank (on another thread) still waits for the other ranks: call it once")
            hint = ("; a gradient bucket is named after its gradients: two optimizer wrappers whose parameters have "
                    "the same names are in flight at once (a GAN's G and D given named_parameters() of modules with "
                    "the same layer names): name them apart, named_parameters=G.named_parameters(prefix='G')"
                    if name.startswith("bucket[") else "")
            raise DuplicateNameError(
                f"tensor {name!r} was submitted on rank {self.job_rank} while an operation with the same name "
                f"is still in flight; names must be unique among outstanding operations{hint}")
        if JOIN_NAME in inflight and name != JOIN_NAME:
            # (a thread's collective while this rank waits in join(): the others already take zeros for this rank,
            # so it was never run, and failed at the shutdown with advice to call join())
            del inflight[name]
            raise InvalidArgumentError(
                f"{req.kind} of tensor {name!r} was submitted on rank {self.job_rank} after this rank called join(): "
                "the other ranks take this rank's part as zeros until every rank has joined, and run nothing of "
                "its own; submit it before join(), or after join() returns")
        self._queue.append(req)
        if wake and self._idle and not self._wake.is_set():  # the idle engine pauses long: start the next cycle now
            self._wake.set()
        return req

    def submit_allreduce(self, array, name, op, prescale, postscale, compression, priority, outputs,
                         allocate: Optional[Callable] = None, wake: bool = True, value=None) -> Handle:
        """``submit()`` of one allreduce, with positional arguments: the call a training step makes once
        per tensor (``aiacc.allreduce_async_``, the adapters' in-place allreduce), so it skips the
        keyword hops and goes straight to the cached signature. Anything unusual takes ``submit()``.
        ``value``: what the handle's ``wait()`` returns instead of the output array (an adapter's own
        tensor, so that it needs no handle of its own around this one); only with a str ``name``."""
        if self._closed or name.__class__ is not str or array.__class__ is not _NDARRAY:
            if value is not None and not self._closed:  # (closed: submit() raises the shutdown's error)
                raise TypeError(f"submit_allreduce of tensor {name!r}: value= needs a str name and a numpy array")
            return self.submit(_ALLREDUCE, array, name=name, op=op, prescale=prescale, postscale=postscale,
                               compression=compression, priority=priority, outputs=outputs, allocate=allocate)
        req = self.requests.allreduce(array, name, op, prescale, postscale, compression,
                                      priority if priority.__class__ is float else as_priority(name, priority), outputs,
                                      allocate, value)
        return self._enqueue(name, req, wake)

    def _timeline_file(self, path: str) -> Optional[str]:
        """This rank's timeline file for ``path``: rank 0's, or with ``timeline_all_ranks`` every rank's
        (``path.rank<N>``); None on the other ranks."""
        if self.rank == 0 or self.config.timeline_all_ranks:  # (a process set's: its first rank's)
            # named by the rank in the job, also a process set's, so that its files and tracks sit beside the
            # global engine's of the same process
            return path if not self.config.timeline_all_ranks else f"{path}.rank{self.job_rank}"
        return None

    def _open_timeline(self, path: str) -> Optional[Timeline]:
        file = self._timeline_file(path)
        return None if file is None else Timeline(file, self.job_rank)

    def set_timeline(self, path: Optional[str], mark_cycles: bool = False) -> None:
        """Horovod's ``start_timeline`` (``path``) and ``stop_timeline`` (None): the timeline being written
        is closed (a complete file) and, with a path, a new one is written from the next cycle on. Between
        two cycles (under the cycle lock), so no cycle writes half into one file and half into the other. The
        file being written again (as Horovod's writer, it goes on; it was cut short by a second writer): only
        ``mark_cycles`` changes."""
        old = self.timeline
        file = None if path is None else self._timeline_file(path)
        if old is not None and file is not None and _same_file(file, old.path):
            self.mark_cycles = bool(mark_cycles)
            return
        new = self._open_timeline(path) if path is not None else None  # (a bad path fails here, nothing changed)
        with self._cycle_lock:
            old = self.timeline
            self.timeline = self.executor.timeline = new
            if path is not None:
                self.mark_cycles = bool(mark_cycles)
        if old is not None:
            old.close()

    def transport_for(self, device: str):
        """MPI for host arrays; NCCL (joined on first use, in the same cycle on every rank) for CUDA arrays."""
        if device == devices.CPU:
            return self.transport
        if self._nccl is None:
            from .transport.nccl import NCCLTransport  # noqa: PLC0415

            self._nccl = NCCLTransport(self.comm, self.local_rank, self.local_comm)
        return self._nccl

    # ---- lifecycle -------------------------------------------------------------------
    def shutdown(self, timeout: Optional[float] = None, reason: Optional[str] = None) -> None:
        """Ask every rank to stop, wait for this rank's thread to end, free MPI resources. ``reason``: what
        operations left unfinished are told (every rank stops for it: the removal of a process set)."""
        if reason is not None:
            self._shutdown_reason = reason
        self._shutdown_requested = True
        self._waker.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self._close_resources()

    def _close_resources(self) -> None:
        if self._thread.is_alive():
            return
        if self.timeline is not None:
            self.timeline.close()
        if self.autotuner is not None:
            self.autotuner.close()
        if self.executor.shared is not None:
            self.executor.shared.close()
        for c in (self.local_comm, self.cross_comm):
            try:
                c.Free()
            except Exception:  # noqa: BLE001
                pass
        self.local_comm = self.cross_comm = None
        self.transport.close()
        if self._nccl is not None:
            self._nccl.close()
        self.executor.close()

    # ---- the background thread ---------------------------------------------------------
    def _idle_sleep(self, idle: bool) -> float:
        """The pause before the next cycle: ``cycle_time``, or up to MAX_IDLE_SLEEP with nothing to do.

        An idle engine still takes part in one negotiation per cycle; at a 1 ms cycle that cost
        about a tenth of a core per rank (measured), taken from training on a machine with as
        many ranks as cores, and at 20 ms still ~0.6 ms of CPU per idle cycle (the ranks' idle
        cycles do not line up, so each waits for the other's: measured 18 cycles and 12 ms of
        engine CPU per 340 ms training step, 2 of them with work). So an engine with nothing left to
        agree on or to send after a cycle pauses up to half a second, and submit() wakes it at
        once. That adds no latency: a
        tensor cannot be agreed before every rank has submitted it, each rank's submit wakes its
        own engine, and a rank that is waiting for the others keeps cycling (inside the
        negotiation's wait). Not while a rank has joined: it contributes without submitting, so
        the others would wait for its pauses.
        """
        if not idle:
            return self.cycle_time
        self._idle = True
        return max(self.cycle_time, MAX_IDLE_SLEEP)

    def _direct_allowed(self, cycle) -> bool:
        """Whether this cycle's cached tensors may be bucketed straight from their cache entries:
        they are all that was agreed, everything agreed is sent now (no credit, no partitions,
        nothing left over), no rank has joined, and the autotuner is not measuring."""
        scheduler = self.scheduler
        return not (cycle.responses or cycle.joined or scheduler.credit_bytes or scheduler.partition_bytes
                    or len(scheduler) or (self.autotuner is not None and not self.autotuner.done))

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._final_cpu = time.thread_time()

    def _loop(self) -> None:
        try:
            while True:
                if self._helpers:  # a waiting thread runs the cycles now; take over when it is done
                    self._idle = True  # (so that a submit wakes this thread, as from an idle pause)
                    self._wake.wait(MAX_IDLE_SLEEP)
                    self._wake.clear()
                    self._idle = False
                    self._gather()  # (a thread that comes to wait, and run the cycles itself, ends it)
                    self._urgent.clear()
                    continue
                with self._cycle_lock:
                    if self._closed:  # a waiting thread ran the cycle that stopped the engine
                        return
                    outcome = self._cycle()
                if outcome is None:
                    return
                start, end, idle = outcome
                remaining = self._idle_sleep(idle) - (end - start)
                if remaining > 0 and not self._shutdown_requested and not (self._idle and self._queue):
                    # (otherwise the next cycle lands finished flights first)
                    self.executor.pause(remaining, self._wake, self._cycle_lock)
                if self._idle:
                    self._gather()
                self._idle = False
                self._wake.clear()
                self._urgent.clear()
                if self._waker.waiters:  # a waiter's signal cleared just now must not be lost
                    self._wake.set()
        except BaseException as exc:  # noqa: BLE001 - must never leave other ranks hanging
            self._fatal(exc)

    def _gather(self) -> None:
        """After an idle pause that a submit ended: wait one cycle time, so that a burst of gradients is
        agreed and fused together; a waiter (which sets ``_urgent``) ends the gathering at once."""
        if self._queue and not self._waker.waiters:
            self._urgent.wait(self.cycle_time)

    def _help(self, handle, deadline: Optional[float] = None) -> bool:
        """Run the engine's cycles on the calling thread, which waits for ``handle`` anyway, until it
        is done (or ``time.perf_counter()`` passes ``deadline``, looked at between cycles: False then):
        a synchronous call then costs no hand-off to the engine thread and back (two thread wake-ups
        through the GIL). While a thread helps, the engine thread starts no cycle of its own
        (one that is running ends first). Cycles are collective and run in the same order on every
        rank, whichever thread of a rank runs them. False on the engine's own thread."""
        if threading.current_thread() is self._thread:
            return False
        waker = self._waker
        waker.quiet_begin()  # the transport hurries (spins) for a waiting thread; nothing to wake
        with self._lock:
            self._helpers += 1
        if not self._urgent.is_set():
            self._urgent.set()  # ends the engine thread's gathering: this thread runs the cycle
        main = threading.current_thread() is threading.main_thread()
        interrupted = in_cycle = False
        try:
            if self._take_cycles(handle, main):
                try:
                    while handle._state != 2 and not self._closed and (deadline is None
                                                                        or time.perf_counter() < deadline):
                        # (the order matters: SIGINT raises only while _MAIN_CYCLE[0] is False, and then
                        # in_cycle is False too: the KeyboardInterrupt came between cycles)
                        _MAIN_CYCLE[0] = main
                        in_cycle = True
                        ran = self._cycle()
                        in_cycle = False
                        _MAIN_CYCLE[0] = False
                        if ran is None or (main and _MAIN_CYCLE[1]):
                            break
                finally:
                    self._helper_cycles = False
                    self._cycle_lock.release()
            if main and _MAIN_CYCLE[1]:  # Ctrl-C during a cycle: raised now, between cycles
                _MAIN_CYCLE[1] = False
                interrupted = True
        except KeyboardInterrupt as exc:
            _MAIN_CYCLE[0] = False
            if in_cycle:  # (the script's own SIGINT handler raised it, or a second Ctrl-C)
                self._fatal(exc)
            interrupted = True
        except BaseException as exc:  # noqa: BLE001 - must never leave other ranks hanging
            _MAIN_CYCLE[0] = False
            self._fatal(exc)
        finally:
            with self._lock:
                self._helpers -= 1
            waker.end()
        if self._queue or self._busy():
            self._wake.set()  # what others submitted meanwhile: the engine thread takes over now
        if interrupted:
            raise KeyboardInterrupt
        return handle._state == 2

    def _take_cycles(self, handle, main: bool) -> bool:
        """Take the cycle lock for ``_help``: True once held (released by the caller). The engine thread's
        cycle ends soon (and it starts none while a thread helps); but while another waiting thread runs
        the cycles, this one must not queue behind it: that thread runs until its own handle is done, which
        may need this thread's next collective on another rank (threads of one rank each running named
        collectives hung the job so). False then: this thread waits for its handle, which the other's
        cycles complete. On the main thread (``main``) a Ctrl-C while the lock is taken is only noted, so
        that no KeyboardInterrupt comes between the acquire and the caller's ``try`` that releases it;
        one noted while the lock is still held elsewhere: False at once (the caller raises it)."""
        lock = self._cycle_lock
        while True:
            if main:
                _MAIN_CYCLE[0] = True
            if lock.acquire(timeout=0.002):
                self._helper_cycles = True
                return True
            if main:
                _MAIN_CYCLE[0] = False
                if _MAIN_CYCLE[1]:
                    return False
            if self._helper_cycles or handle._state == 2:
                return False

    def _cycle(self):
        """One cycle (the caller holds the cycle lock): drain, negotiate, schedule, execute. Returns
        (start, end, idle), or None once the engine has stopped. Its CPU time is counted for ``summary()``
        (whichever thread runs it)."""
        cpu = time.thread_time()
        waker = self._waker
        waker.cycle_thread = threading.get_ident()  # (a completion callback that waits there is an error)
        try:
            return self._run_cycle()
        finally:
            waker.cycle_thread = None
            self.stats["cycle_cpu_seconds"] += time.thread_time() - cpu

    def _run_cycle(self):
        negotiator, scheduler, executor = self.negotiator, self.scheduler, self.executor
        start = time.perf_counter()
        self._drain()
        executor.progress()
        due = self.stall.due(negotiator.waiting)
        may_send = executor.flight_cycles() < PIPELINE_DEPTH
        cycle = negotiator.cycle(self._shutdown_requested, due or self._report_wanted > 0, may_send)
        executor.cycle_no = negotiator.cycle_no
        if cycle.entries:
            self.stats["agreed_from_cache"] += len(cycle.entries)
        if cycle.responses:
            self.stats["negotiated"] += len(cycle.responses)
        agreed = time.perf_counter()
        if self.timeline is not None:
            for r in cycle.cached:
                if r is not None:
                    r.t_agreed = agreed
            for r in cycle.responses:
                if r.request is not None:
                    r.request.t_agreed = agreed
        stopping = cycle.shutdown or (cycle.stall_check and self._stall_check(agreed, due))
        pipelined = scheduler.credit_bytes > 0
        runs = None
        if cycle.entries and not stopping and self._direct_allowed(cycle):
            runs = self._plans.runs(cycle.entries, cycle.cached, self.fusion_threshold, scheduler.priority,
                                    self.size)
        responses = []
        if runs is not None:
            sent = executor.run_all(runs, pipelined)
        else:
            responses = negotiator.responses_of(cycle)
            if responses:
                scheduler.push(responses)
            if stopping:
                sent = executor.execute(plan_buckets(scheduler.take(everything=True), self.fusion_threshold),
                                        pipelined)
            elif cycle.may_send and len(scheduler):
                sent = executor.execute(plan_buckets(scheduler.take(), self.fusion_threshold), pipelined)
            else:
                sent = 0
        end = time.perf_counter()
        timeline = self.timeline
        if timeline is not None:
            if self.mark_cycles:
                timeline.instant("cycles", "CYCLE_START", start)
            if cycle.entries or cycle.responses or sent:
                timeline.span("cycles", "cycle", start, end,
                              {"agreed": len(cycle.entries) + len(cycle.responses), "bytes": sent})
            timeline.flush()  # (a file read while the job runs shows this cycle's work)
        if self.autotuner is not None:
            self.autotuner.on_cycle(responses)
        if stopping:
            executor.progress(negotiator.cycle_no)  # everything posted lands first
            self._stop(cycle.shutdown)
            return None
        return start, end, not (cycle.joined or self._busy())

    def _busy(self) -> bool:
        """Whether requests wait for agreement, agreed ones for sending, or sent ones for landing."""
        return bool(self.negotiator.has_waiting() or len(self.scheduler) or self.executor.flights)

    def _drain(self) -> None:
        q = self._queue
        if self.timeline is not None:  # each request stamped as it is taken (submits may append meanwhile)
            now = time.perf_counter()
            seen = collections.deque()
            while q:
                req = q.popleft()
                req.t_seen = now
                seen.append(req)
            q = seen
        self.negotiator.add_all(q)

    def _complete_all(self, reqs) -> None:
        """Finish allreduces with their outputs (the steady state's many small tensors, no timeline)."""
        finish_allreduces(reqs, self._inflight)

    def _complete(self, req: Request, result, error: Optional[BaseException], t_done: Optional[float] = None) -> None:
        self._inflight.pop(req.name, None)
        if self.timeline is not None and error is not None:  # (Horovod's: the tensor's track ends in ERROR)
            t_done, seen = t_done or time.perf_counter(), req.stamp("t_seen")
            agreed, kind = req.stamp("t_agreed", t_done if seen is not None else None), Collective(req.kind)
            message = (str(error).splitlines() or [""])[0]
            self.timeline.tensor(kind, req.name, ((QUEUE, req.t_submit, seen), (negotiate_phase(kind), seen, agreed),
                                                  ("ERROR", agreed or req.t_submit, t_done,
                                                   {"error": f"{type(error).__name__}: {message}"})))
        elif self.timeline is not None:
            t_done = t_done or time.perf_counter()
            seen, agreed, packed, sent, unpacked = (req.stamp(t) for t in ("t_seen", "t_agreed", "t_pack", "t_comm",
                                                                            "t_unpack"))
            kind = Collective(req.kind)
            self.timeline.tensor(kind, req.name, (
                (QUEUE, req.t_submit, seen),
                (negotiate_phase(kind), seen, agreed),
                (PACK, packed, sent),
                (op_phase(kind), sent, unpacked, {"op": str(kind), "bytes": int(sum(a.nbytes for a in req.inputs))}),
                (UNPACK, unpacked, t_done),
            ))
        req._set(result, error)

    # ---- what it did ----------------------------------------------------------------------
    def summary(self) -> dict:
        """What this rank's engine has done so far (``aiacc.summary()``; printed by rank 0 at shutdown with
        ``AIACC_SUMMARY=1``). Allreduce requests are calls (a grouped allreduce or an optimizer's gradient
        bucket counts once); collectives are the reductions run for them after fusion. Cycles run on a thread
        that waits for a handle (``caller_cycles``) count as well: ``cycle_cpu_seconds`` is the CPU of every
        cycle on whichever thread ran it, ``engine_thread_cpu_seconds`` all of the engine thread's (its cycles
        and its waits). A process set's operations are its own engine's."""
        s = self.stats
        shared = self.executor.shared
        out = {
            "rank": self.rank, "ranks": self.size, "cycles": self.negotiator.cycle_no,
            "allreduce_requests": int(s["allreduce_requests"]), "allreduces": int(s["allreduces"]),
            "allreduce_bytes": int(s["bytes"]),
            "through_shared_window": int(s["through_shared_window"]) if shared is None else int(shared.reductions),
            "allreduce_seconds": float(s["allreduce_seconds"]),
            "agreed_from_cache": int(s["agreed_from_cache"]), "negotiated": int(s["negotiated"]),
        }
        for kind in _OTHER_KINDS:
            out[kind] = int(s[kind])
        out["cycle_cpu_seconds"] = float(s["cycle_cpu_seconds"])
        out["engine_thread_cpu_seconds"] = self._engine_cpu()
        return out

    def _engine_cpu(self) -> float:
        if self._thread.is_alive():
            try:
                return time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident))
            except (AttributeError, OSError):  # (no per-thread CPU clock here, or the thread just ended)
                pass
        return self._final_cpu

    def summary_text(self) -> str:
        """:meth:`summary` as one line."""
        d = self.summary()
        requests, collectives = d["allreduce_requests"], d["allreduces"]
        per = f"{requests / collectives:.1f} per collective, " if collectives else ""
        shared = d["through_shared_window"]
        window = f"{shared} through the shared-memory window, " if shared else ""
        others = ", ".join(f"{d[k]} {k}" for k in _OTHER_KINDS if d[k])
        return (f"aiacc rank {d['rank']} of {d['ranks']}: {requests} allreduce requests in {collectives} collectives "
                f"({per}{d['allreduce_bytes'] / 1e6:.1f} MB, {window}{d['allreduce_seconds']:.3f} s packing, "
                f"reducing and unpacking); {d['agreed_from_cache']} operations agreed from the response cache and "
                f"{d['negotiated']} by full negotiation in {d['cycles']} cycles"
                + (f"; other collectives: {others}" if others else "")
                + f"; CPU {d['cycle_cpu_seconds']:.3f} s in cycles, {d['engine_thread_cpu_seconds']:.3f} s on the "
                  "engine thread")

    # ---- stalls -------------------------------------------------------------------------
    def _stall_check(self, now: float, due: bool = True) -> bool:
        """Collective stall report. Returns True when every rank must stop. ``due``: this rank asked for it (its
        stall inspector's time had come). A report some rank asked for only to name the ranks a timed-out wait
        waits for (``missing_ranks``) goes to the inspector only where it holds a tensor past the inspector's
        limit, so that the inspector warns and stops as it would have without it."""
        report = self.negotiator.stall_report(now)
        with self._reports:
            self._report, self._report_no = report, self._report_no + 1
            self._reports.notify_all()
        limit = self.stall.limit
        if not limit or not (due or any(item.age >= limit for item in report)):
            return False
        error = self.stall.check(report)
        if error is None:
            return False
        self._stop_error = error
        return True

    def missing_ranks(self, name: str, wait: float) -> Optional[Tuple[list, list]]:
        """The ranks (of the job) that have submitted the operation ``name`` and those that have not, as the
        stall inspector's collective report tells it, asked for now (every rank's engine takes part in its next
        cycle): ``(have, missing)``; ``([], [])`` when no rank still waits for it to be agreed (every rank has
        submitted it: it is agreed and running, or done); None when no report came within ``wait`` seconds (the
        other ranks' engines did not answer) or the engine has stopped. For the error of a wait that timed
        out, called from the waiting thread (never the engine's)."""
        with self._reports:
            seen = self._report_no
            self._report_wanted += 1
        try:
            self._waker.set()  # (the engine thread may pause: it starts the cycle now)
            deadline = time.monotonic() + wait
            with self._reports:
                while self._report_no == seen:
                    left = deadline - time.monotonic()
                    if left <= 0 or self._closed:
                        return None
                    self._reports.wait(left)  # (notified by each report, and when the engine stops)
                report = self._report
        finally:
            with self._reports:
                self._report_wanted -= 1
        for item in report:
            if item.name == name:
                return list(item.have), list(item.missing)
        return [], []

    def _on_slow_wait(self, waited: float) -> None:
        """Called while this engine waits long for the other ranks' engines in negotiation."""
        if self.stall.engines_silent(waited):
            _flush_std()
            self.transport.abort(1)

    # ---- stopping ----------------------------------------------------------------------
    def _stop(self, shutdown_agreed: bool) -> None:
        if self._stop_error is None and shutdown_agreed:
            # (the reason travels with the request: a rank whose engine stops for another rank's request before its
            # own shutdown(reason=...) call, a process set's member that is late to remove it, tells it too)
            who = self.transport.allgather_object((self._shutdown_requested, self._shutdown_reason))
            ranks = [r for r, (asked, _) in enumerate(who) if asked]
            reason = self._shutdown_reason or next((why for asked, why in who if asked and why), None)
            if self.job_ranks is not None:
                ranks = [self.job_ranks[r] for r in ranks]
            self._stop_error = ShutdownError(
                reason or f"aiacc was shut down by rank{'s' if len(ranks) > 1 else ''} "
                          f"{','.join(map(str, ranks))} (shutdown() or the end of the script; if it ran out of "
                          "data before this rank, end each rank's training loop with join())")
            # every rank's engine agreed to stop: no rank waits in a collective of aiacc's any more, so the
            # job need not be aborted when nobody catches the error (the ranks' own exit statuses stand)
            self._stop_error.engines_stopped = True
            # the shared window is freed here, in the cycle every rank's engine stops in (MPI_Win_free is collective):
            # not by shutdown()'s caller, as a rank whose engine stopped at another's request may never call it (a
            # torch sub-group destroyed on one member: the member waited in Win_free for ever)
            shared, self.executor.shared = self.executor.shared, None
            if shared is not None:
                self.stats["through_shared_window"] = int(shared.reductions)  # (the shutdown summary's, after this)
                shared.close()
        self._closed = True
        with self._reports:
            self._reports.notify_all()
        leftovers = self.negotiator.take_all()
        while self._queue:
            leftovers.append(self._queue.popleft())
        for req in leftovers:
            err = self._stop_error
            if isinstance(err, ShutdownError):
                err = ShutdownError(f"{req.kind} of tensor {req.name!r} on rank {self.job_rank} did not complete: "
                                    f"{err}")
                err.engines_stopped = getattr(self._stop_error, "engines_stopped", False)
            self._complete(req, None, err)

    def forked(self, error: BaseException) -> None:
        """In a process forked from this rank: no engine thread runs here, and the communicators and the shared
        window are the parent's. Every submit (``_closed``) and every wait for an operation still pending (the
        waiter's helper) raises ``error``; nothing is stopped (that is collective)."""
        self._closed = True
        self._stop_error = error

        def refuse(_handle, _deadline=None):
            raise error

        self._waker.helper = refuse

    def _fatal(self, exc: BaseException) -> None:
        self._stop_error = AiaccError(f"aiacc engine on rank {self.job_rank} failed: {exc!r}")
        if isinstance(exc, KeyboardInterrupt):  # (the script's own SIGINT handler raised it inside a cycle)
            logger.critical("aiacc: interrupted (KeyboardInterrupt) on rank %d in the middle of a collective cycle "
                            "the other ranks take part in; ending the job", self.job_rank)
        else:
            logger.critical("aiacc: the engine thread on rank %d failed; ending the job", self.job_rank, exc_info=exc)
        self._closed = True
        with self._reports:
            self._reports.notify_all()
        try:
            for req in self.negotiator.take_all() + list(self._queue):
                req._set(None, self._stop_error)
        finally:
            if self.size > 1:
                _flush_std()
                self.transport.abort(1)


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
