"""The public API on numpy arrays; adapters build on the same functions.

With ``AIACC_ENABLE`` unset or 0, ``init()`` makes this process rank 0 of 1
without starting MPI or a thread, and every collective runs as it would in a
real job of one rank (``aiacc.local``).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from typing import List, NamedTuple, Optional, Sequence

import numpy as np

from . import config as _config
from .exceptions import AiaccError, InvalidArgumentError, NotInitializedError
from .ops import Average, Collective, ReduceOp
from .requests import check_root_rank

logger = logging.getLogger("aiacc")

__all__ = [
    "init", "shutdown", "is_initialized", "is_enabled", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "mpi_threads_supported", "submit", "synchronize", "synchronize_all", "poll",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_async",
    "grouped_allreduce_", "grouped_allreduce_async_", "allgather", "allgather_async", "broadcast", "broadcast_async",
    "alltoall", "alltoall_async",
    "reducescatter", "reducescatter_async", "grouped_allgather", "grouped_allgather_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "barrier", "join", "get_engine", "engine_for",
    "outside_process_set", "process_set_by_id", "add_process_set", "remove_process_set",
    "switched_off", "gradient_engine", "GradientEngine", "set_size", "set_rank", "check_root", "start_timeline",
    "stop_timeline",
]


class _State:
    def __init__(self):
        self.lock = threading.RLock()
        self.initialized = False
        self.config: Optional[_config.Config] = None
        self.engine = None
        self.atexit_registered = False
        self.hook_installed = False
        self.warned_alone = False
        self.warned_horovod = False  # Horovod's variables aiacc does not read were named (once a process)
        self.local = None  # the job of one rank that runs the collectives while aiacc is switched off
        self.sets = None  # the registered process sets (aiacc.process_sets.ProcessSetTable)
        self.shut_down = False  # shutdown() ran since the last init(): what a call before init() is told
        self.forked = False  # this process was forked from a rank after init(): aiacc is the parent's
        self.dynamic_sets = False  # init(process_sets="dynamic") asked for dynamic sets (whatever the setting)
        self.joined = False  # join() has returned on this rank: ranks count their steps differently from here


_state = _State()


# ---- lifecycle ---------------------------------------------------------------------------
def init(comm=None, process_sets=None) -> None:
    """Start aiacc on this process (idempotent).

    ``comm``: an mpi4py communicator to run on instead of ``MPI.COMM_WORLD``, or (Horovod's other form) a
    list of ranks of ``MPI.COMM_WORLD``: every rank calls ``init`` with it, and one outside it gets a
    ValueError naming it. ``process_sets``:
    ``ProcessSet`` objects to register now, with Horovod's rules (``ProcessSetTable.add_at_init``: sets of
    ranks the same on every rank, sets of communicators each rank's own; an entry that repeats another
    raises ValueError with the job initialized and the others registered), or ``"dynamic"`` (Horovod's
    form 3: none now, ``add_process_set`` later; allowed anyway unless ``AIACC_DYNAMIC_PROCESS_SETS=0``,
    which this overrides, as Horovod's form sets ``HOROVOD_DYNAMIC_PROCESS_SETS=1``). Called again once initialized,
    it registers the ``process_sets`` given (collectively) and does nothing else.
    Validates every ``AIACC_*`` variable; a bad value raises ConfigError.
    """
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ValueError(f"init: process_sets must be a list of ProcessSet objects or 'dynamic', got "
                             f"{process_sets!r}")
        process_sets = None
        _state.dynamic_sets = True
    with _state.lock:
        if _state.initialized:
            if process_sets and _state.sets is not None:
                _state.sets.add_at_init(process_sets)  # (Horovod: init again after a list with a repeat)
            return
        cfg = _config.from_env()
        _configure_logging(cfg.log_level)
        _state.config = cfg
        if not cfg.enable:
            # (the errors of `aiaccrun -np 1`, a job of one rank, without starting MPI: an object of mpi4py's passes)
            _check_comm(comm, lambda c: type(c).__module__.startswith("mpi4py"))
            if isinstance(comm, (list, tuple, range)):
                _check_ranks(list(comm), 1)
            launched = _config.launched_as()
            if launched and launched[0] > 1 and not _state.warned_alone:
                _state.warned_alone = True
                n, var, who = launched
                logger.warning("aiacc is disabled (AIACC_ENABLE is not 1) but %s started this process as one of %d "
                               "ranks (%s=%d): each rank trains alone on its own data. Launch with `aiaccrun -np %d "
                               "...`%s.", who, n, var, n, n, " instead: aiacc's ranks meet through MPI, not torchrun's "
                               "rendezvous (aiaccrun sets torchrun's variables too)" if who == "torchrun"
                               else " or set AIACC_ENABLE=1")
            _state.initialized = True
            from .process_sets import global_process_set  # noqa: PLC0415

            global_process_set.ranks = [0]  # the job of one rank (size() 1, rank() 0, as under aiaccrun -np 1)
            _warn_unread_horovod()
            if process_sets:
                _one_rank_init_sets(process_sets)  # (last, as below: the job is initialized)
            return
        from .engine import Engine  # noqa: PLC0415 - MPI starts here, not at import
        from .process_sets import ProcessSetTable  # noqa: PLC0415
        from .transport.mpi import import_mpi  # noqa: PLC0415

        child = _spawned_child()
        if child is not None:  # (before MPI starts: its start-up would fail on the launcher's pipe, the rank's)
            raise AiaccError(f"aiacc.init() was called in {child}: such a process cannot join the MPI job, whose "
                             "ranks the launcher starts, and with the 'spawn' or 'forkserver' start method (a torch "
                             "DataLoader's multiprocessing_context, a Pool) it runs the script's top level again. Put "
                             "hvd.init() and the training under `if __name__ == \"__main__\":`")
        _refuse_a_rank_alone(import_mpi(cfg.start_timeout, cfg.variable("start_timeout")))
        _check_comm(comm, lambda c: isinstance(c, import_mpi().Comm))
        if isinstance(comm, (list, tuple, range)):
            comm = _comm_of_ranks(list(comm), cfg.start_timeout)
        engine = _state.engine = Engine(cfg, comm, spare_comm=True)
        _state.sets = ProcessSetTable(engine.spare_comm, cfg, engine, engine.rank, engine.size,
                                      lambda config, sub, ranks: Engine(config, sub, job_ranks=ranks))
        _state.initialized = True
        from .process_sets import global_process_set  # noqa: PLC0415

        global_process_set.mpi_comm = comm  # (Horovod's; None for MPI.COMM_WORLD by default)
        if engine.rank == 0:  # (every rank has the same environment under aiaccrun: said once)
            _warn_unread_horovod()
            logger.debug("aiacc started on %d ranks; settings: %s", engine.size, cfg.describe())
        from . import exits  # noqa: PLC0415
        from mpi4py import MPI  # noqa: PLC0415

        exits.watch(MPI.COMM_WORLD.Get_rank())  # (for aiaccrun: a rank mpiexec ends after another left early)
        if not _state.atexit_registered:
            atexit.register(_shutdown_at_exit)
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _state.atexit_registered = True
        if _state.engine.size > 1 and not _state.hook_installed:
            _install_abort_on_exception()
            _state.hook_installed = True
        if _state.engine.size > 1 and cfg.caller_cycles:
            from .engine import defer_interrupts  # noqa: PLC0415

            defer_interrupts(True)  # Ctrl-C waits for the end of a cycle the main thread runs
        if process_sets:
            _state.sets.add_at_init(process_sets)  # last: a repeated entry raises with the job initialized


def _refuse_a_rank_alone(MPI) -> None:  # noqa: N803 - the module
    """A RuntimeError when this process's launcher started it as one of several ranks but MPI sees it alone: started
    by torchrun, or by the mpiexec of another MPI library than mpi4py's (Open MPI's beside the ``mpich`` wheel), every
    rank is a job of one and would train alone without a word."""
    launched = _config.launched_as()
    if launched is None or launched[0] <= 1 or MPI.COMM_WORLD.Get_size() != 1:
        return
    n, var, who = launched
    library = MPI.Get_library_version().strip().splitlines()[0]
    fix = ("aiacc's ranks meet through MPI, not torchrun's rendezvous: start the job with `aiaccrun -np "
           f"{n} python train.py` (it sets torchrun's RANK, WORLD_SIZE and LOCAL_RANK too)" if who == "torchrun" else
           f"the launcher must be the mpiexec of the MPI library mpi4py loads ({library}): `aiaccrun -np {n} ...` "
           "finds it")
    raise RuntimeError(f"aiacc.init: {who} started this process as one of {n} ranks ({var}={n}), but MPI sees it "
                       "alone, in a job of 1: the ranks cannot reach each other, and each would train alone on its "
                       f"own data. {fix}.")


def _warn_unread_horovod() -> None:
    """Name the Horovod variables set here that aiacc does not read, with why (they would change nothing), and
    the variables set to another value than the variable that decides their setting."""
    unread = _config.unread_horovod_variables()
    shadowed = _config.shadowed_variables()
    if (unread or shadowed) and not _state.warned_horovod:
        _state.warned_horovod = True
        if unread:
            logger.warning("aiacc does not read Horovod's %s: %s", "variable" if len(unread) == 1 else "variables",
                           "; ".join(unread))
        if shadowed:  # (two names of one setting, set apart: the first one read decides)
            logger.warning("aiacc: %s", "; ".join(shadowed))


def _check_ranks(ranks: list, size: int) -> None:
    """``init(comm=ranks)``: distinct ranks of a world of ``size``, or a ValueError naming them."""
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < size]
    if bad or not ranks or len(set(ranks)) != len(ranks):
        raise ValueError(f"init(comm={ranks!r}): expected distinct ranks of MPI.COMM_WORLD, 0..{size - 1}"
                         + (f" (not: {bad!r})" if bad else ""))


def _check_comm(comm, is_comm) -> None:
    """``init(comm=...)``: None, a list of ranks (checked by ``_check_ranks``) or a communicator (``is_comm``)."""
    if comm is not None and not isinstance(comm, (list, tuple, range)) and not is_comm(comm):
        raise TypeError(f"init(comm=...) takes an mpi4py communicator or a list of ranks of MPI.COMM_WORLD, got "
                        f"{type(comm).__name__} {comm!r}")  # (it was AttributeError: 'int' ... 'Dup')


def _comm_of_ranks(ranks: list, start_timeout: float = 0.0):
    """The communicator of ``ranks`` (of ``MPI.COMM_WORLD``, in that order): collective over every rank."""
    from .transport.mpi import import_mpi  # noqa: PLC0415

    world = import_mpi(start_timeout).COMM_WORLD
    _check_ranks(ranks, world.Get_size())
    group = world.Get_group()
    sub = group.Incl(ranks)
    try:
        comm = world.Create(sub)
    finally:
        sub.Free()
        group.Free()
    if comm == import_mpi().COMM_NULL:
        raise ValueError(f"init(comm={ranks!r}): this process (rank {world.Get_rank()} of MPI.COMM_WORLD) is not "
                         "among those ranks; start only those, or leave it out of aiacc")
    return comm


def _configure_logging(level: str) -> None:
    """AIACC_LOG_LEVEL sets aiacc's logger; below WARNING it also gets a stderr handler of its own
    (Python shows only warnings and errors of a logger nobody configured)."""
    logger.setLevel(level)
    if logging.getLevelName(level) < logging.WARNING and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[aiacc %(levelname)s] %(message)s"))
        logger.addHandler(handler)


def shutdown() -> None:
    """Stop the engine on every rank (collective: the others' pending operations fail with ShutdownError)."""
    with _state.lock:
        engine, sets = _state.engine, _state.sets
        _state.engine = _state.sets = None
        _state.shut_down = _state.initialized or _state.shut_down
        _state.initialized = False
    if _state.forked:  # (a forked child: the engines are the parent's, and stopping them is collective)
        return
    if sets is not None:
        sets.shutdown()
    if engine is not None:
        from .engine import defer_interrupts  # noqa: PLC0415
        from .fusion import SEEN_WHILE_JOINED  # noqa: PLC0415

        SEEN_WHILE_JOINED.clear()  # (the next engine numbers its bucket setups from 0 again)

        defer_interrupts(False)
        engine.shutdown()
        if engine.config.summary and engine.rank == 0:
            sys.stderr.write(engine.summary_text() + "\n")
            sys.stderr.flush()


def summary() -> dict:
    """What this rank's engine has done since ``init()`` (a dict: allreduce requests and the collectives
    run for them, bytes, the shared-memory window's share, time packing/reducing/unpacking, operations
    agreed from the response cache and by full negotiation, cycles, other collectives by kind, the engine
    thread's CPU seconds). ``AIACC_SUMMARY=1`` / ``aiaccrun --summary``: rank 0 prints it at shutdown.
    With aiacc switched off: ``{"enabled": False}``."""
    e = _need("summary")
    return {"enabled": False} if e is None else {"enabled": True, **e.summary()}


def _shutdown_at_exit() -> None:
    try:
        shutdown()
    except Exception:  # noqa: BLE001 - interpreter is exiting
        logger.exception("aiacc: shutdown at exit failed")


def _after_fork_in_child() -> None:
    """In a process forked from a rank after ``init()`` (``os.fork()``, a DataLoader worker with the 'fork'
    start method): aiacc's engines, MPI's communicators and the shared window are the parent's. A collective
    here used to run the engine's cycles on them from a second process: a hang of the whole job, or, with
    every rank forking, the children's collectives mixed into the parents' channels. Now every submit and
    every wait for an operation still pending raises an error saying so, and nothing is shut down at exit."""
    engine = _state.engine
    if engine is None:
        return
    _state.forked = True
    error = AiaccError(f"aiacc cannot be used in a process forked from rank {engine.job_rank} after aiacc.init() "
                       "(os.fork(), a torch DataLoader worker with the default 'fork' start method): MPI and aiacc's "
                       "engine belong to the parent process: communicate there")
    sets = _state.sets
    for e in (sets.engines.values() if sets is not None else [engine]):
        e.forked(error)


def _restart_would_fail(error: BaseException) -> Optional[BaseException]:
    """The error a restart would meet again (``restart_would_fail``), also where it came wrapped: as the cause or
    context of another (TensorFlow's autograph raises a StagingError around an error inside a ``tf.function``)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if getattr(error, "restart_would_fail", False):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _install_abort_on_exception() -> None:
    """An exception nobody caught on any rank ends the whole job (mpi4py's ``-m mpi4py`` behaviour),
    so the other ranks never wait forever in a collective."""
    previous = sys.excepthook

    def abort_job(etype, value, tb):
        previous(etype, value, tb)
        if _state.forked:  # a forked child is no rank: aborting would end the parents' job
            return
        final = _restart_would_fail(value)
        if final is not None:  # (an elastic directory of another job: every restart failed the same way, the
            from . import exits  # noqa: PLC0415         # reset callbacks run for nothing)

            exits.no_restart(f"{type(final).__name__}: {final}")
        engine = _state.engine
        # (also when the error came wrapped: torch's DDP raises a RuntimeError around the ShutdownError)
        if getattr(value, "engines_stopped", False) or getattr(getattr(engine, "_stop_error", None),
                                                               "engines_stopped", False):
            # A rank's script ended (or called shutdown()) while this one waited for it: every engine has
            # stopped, so nothing hangs if this rank just exits; aborting would kill the rank that ended
            # before its own exit status reached aiaccrun (a sys.exit(3) reported as 1).
            sys.stderr.write(f"aiacc: unhandled {etype.__name__} on rank {engine.rank if engine else '?'}; "
                             "every rank's engine has stopped, the job is not aborted\n")
            sys.stderr.flush()
            return
        if engine is not None and engine.size > 1:
            try:
                sys.stderr.write(f"aiacc: unhandled {etype.__name__} on rank {engine.rank}; "
                                 f"aborting all {engine.size} ranks\n")
                sys.stderr.flush()
                sys.stdout.flush()
                _write_out_captured_stderr()
            finally:
                engine.transport.abort(1)

    sys.excepthook = abort_job


def _write_out_captured_stderr() -> None:
    """A hook around this one may have swapped ``sys.stderr`` for a buffer it writes out when this one returns:
    torch.distributed's (``init_process_group`` installs it, to put ``[rank<k>]:`` before each line). The abort never
    returns, so the traceback went nowhere: a job on the ``aiacc`` torch backend ended with MPI's one line. It is
    written to the process's own stderr here."""
    captured, real = sys.stderr, sys.__stderr__
    if captured is real or real is None or not hasattr(captured, "getvalue"):
        return
    try:
        real.write(captured.getvalue())
        real.flush()
    except Exception:  # noqa: BLE001 - nothing may prevent the abort
        pass


def _need(fn: str, what: Optional[str] = None):
    """The engine (None switched off) once ``init()`` ran; else NotInitializedError naming the call: ``what``, or
    ``aiacc.fn()`` (an adapter's ``broadcast_parameters`` named the ``aiacc.size()`` it calls)."""
    if not _state.initialized:
        call = what or f"aiacc.{fn}()"
        if _state.shut_down:
            raise NotInitializedError(f"{call} was called after aiacc.shutdown(); call aiacc.init() again first")
        child = _spawned_child()
        raise NotInitializedError(f"{call} was called before aiacc.init()" + (
            f" in {child}, which has no aiacc of its own: aiacc runs in the rank's own process; hand the worker what "
            "it needs (the rank, the size) as an argument" if child else ""))
    return _state.engine


def _spawned_child() -> Optional[str]:
    """Which process this is, when multiprocessing started it from a rank of a launched job (a torch DataLoader worker
    with the 'spawn' or 'forkserver' start method, a Pool's worker); else None."""
    import multiprocessing  # noqa: PLC0415

    # (while such a process imports the script as __mp_main__, before its bootstrap, parent_process() is still None:
    # multiprocessing's own check of that phase reads ``_inheriting``)
    started = multiprocessing.parent_process() is not None or getattr(multiprocessing.current_process(),
                                                                       "_inheriting", False)
    if not started or _config.launched_as() is None:
        return None
    from .transport.mpi import _RANK_VARS  # noqa: PLC0415 - (the variables the start-up timeout's message reads)

    rank = next((os.environ[v] for v in _RANK_VARS if os.environ.get(v)), None)
    return (f"process {multiprocessing.current_process().name} (pid {os.getpid()}), which multiprocessing started "
            f"from {'rank ' + rank if rank is not None else 'a rank'}")


def get_engine():
    """The running Engine, or None when aiacc is disabled (for adapters)."""
    return _need("get_engine")


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Horovod's ``hvd.start_timeline``: write a timeline to ``file_path`` from now on (rank 0's; every rank's,
    as ``file_path.rank<N>``, with ``AIACC_TIMELINE_ALL_RANKS``; a process set's engine to
    ``file_path.set<id>``), closing the one being written. ``mark_cycles``: a ``CYCLE_START`` mark per cycle.
    Unlike Horovod it needs no ``HOROVOD_TIMELINE=DYNAMIC`` (which aiacc accepts: no file until this call).
    Each rank changes its own file (no collective); switched off there is nothing to record."""
    if not isinstance(file_path, (str, os.PathLike)) or not os.fspath(file_path):
        raise ValueError(f"start_timeline: file_path must be a file path, got {file_path!r}")
    _set_timeline("start_timeline", os.fspath(file_path), mark_cycles)


def stop_timeline() -> None:
    """Horovod's ``hvd.stop_timeline``: close the timeline being written (a complete JSON file); nothing to do
    when none is."""
    _set_timeline("stop_timeline", None, False)


def _set_timeline(fn: str, path, mark_cycles: bool) -> None:
    engine = _need(fn)
    if engine is None:
        return
    sets = _state.sets
    if sets is not None:  # (the sets added from now on write this timeline, or none after a stop)
        sets.timeline = (path or "", bool(mark_cycles))
    engines = sets.engines.items() if sets is not None else [(0, engine)]
    for set_id, e in list(engines):
        try:
            e.set_timeline(path if path is None or set_id == 0 else f"{path}.set{set_id}", mark_cycles)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{fn}: cannot write the timeline {path!r}: {exc}") from exc


def running_engine():
    """The running Engine, or None (disabled, not initialized, shut down): never raises. For the adapters'
    per-tensor fast paths, which fall back to ``submit`` (and its errors) on None."""
    return _state.engine


def is_initialized() -> bool:
    return _state.initialized


def is_enabled() -> bool:
    """Whether the engine runs (after init) or would run (before init: AIACC_ENABLE)."""
    if _state.initialized:
        return _state.engine is not None
    return _config.from_env().enable


def rank() -> int:
    e = _need("rank")
    return 0 if e is None else e.rank


def size() -> int:
    e = _need("size")
    return 1 if e is None else e.size


def local_rank() -> int:
    e = _need("local_rank")
    return 0 if e is None else e.local_rank


def local_size() -> int:
    e = _need("local_size")
    return 1 if e is None else e.local_size


def cross_rank() -> int:
    e = _need("cross_rank")
    return 0 if e is None else e.cross_rank


def cross_size() -> int:
    e = _need("cross_size")
    return 1 if e is None else e.cross_size


def is_homogeneous() -> bool:
    """Horovod's ``hvd.is_homogeneous()``: whether every host runs the same number of ranks (emulated hosts
    count as hosts). True in a job of one rank or with aiacc switched off."""
    e = _need("is_homogeneous")
    return True if e is None else e.uniform_hosts


def mpi_threads_supported() -> bool:
    """Horovod's: whether MPI runs with MPI_THREAD_MULTIPLE (aiacc asks for it; a script that started MPI
    itself at a lower level gets what it asked for). False with aiacc switched off."""
    e = _need("mpi_threads_supported")
    return e is not None and e.mpi_thread_multiple


# ---- handles -------------------------------------------------------------------------------
def submit_allreduce(array, name, op, prescale, postscale, compression, priority, outputs, process_set=None,
                     wake: bool = True):
    """``submit(ALLREDUCE, array, ...)`` of one tensor with positional arguments: the call a training step
    makes once per tensor (``allreduce_async_`` here and in the adapters), with no keyword hops on the way
    to the engine. ``outputs``: ``[array]`` in place, else None. ``wake`` False: the caller waits for the
    handle right away (a synchronous call), so the engine thread is left asleep."""
    engine = _state.engine
    if engine is not None and process_set is None:
        return engine.submit_allreduce(array, name, op, prescale, postscale, compression, priority, outputs, None,
                                       wake)
    return submit(Collective.ALLREDUCE, array, name=name, op=op, prescale=prescale, postscale=postscale,
                  compression=compression, priority=priority, outputs=outputs, process_set=process_set)


def synchronize(handle):
    """Wait for an ``*_async`` operation and return its result."""
    try:
        return handle.wait()
    except AttributeError:
        _not_a_handle("synchronize", handle)
        raise


def _not_a_handle(what: str, handle) -> None:
    """Raise the TypeError for ``what(handle)`` when ``handle`` is not an ``*_async`` call's handle (an
    AttributeError from inside a real handle goes on as it is: the caller re-raises it)."""
    if not (hasattr(handle, "wait") and hasattr(handle, "done")):
        raise TypeError(f"{what}() takes the handle an *_async call returned, not {type(handle).__name__} "
                        f"{handle!r}") from None


def synchronize_all(handles) -> list:
    """Every handle's result, in order. Waits for all of them even when one fails (none stays in
    flight, writing into memory the caller may reuse), then raises the first error."""
    results, error = [], None
    for h in handles:
        try:
            results.append(h.wait())
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the others have finished
            results.append(None)
            error = error or exc
    if error is not None:
        raise error
    return results


def poll(handle) -> bool:
    """True if the operation behind ``handle`` has finished (never blocks)."""
    try:
        return handle.done()
    except AttributeError:
        _not_a_handle("poll", handle)
        raise


def submit(kind: Collective, arrays, process_set=None, **kwargs):
    """Queue one operation on the engine (of ``process_set``); switched off, run it at once as rank 0
    of a job of one rank (through the same checks). Used by adapters."""
    engine = _state.engine
    if engine is not None and process_set is None:  # the common case first: the job's engine
        return engine.submit(kind, arrays, **kwargs)
    if not _state.initialized:
        _need(str(Collective(kind)))
    if process_set is not None:
        what = f"{Collective(kind)} of {kwargs.get('name') or '(unnamed)'!r}"
        if engine is None:
            _one_rank_sets(process_set, what)
        else:
            # the root first: a root outside the set is the same error on every rank, in every adapter
            root = None if "root" not in kwargs else check_root(
                kwargs["root"], f"broadcast of tensor {kwargs.get('name') or '(unnamed)'!r}", process_set)
            engine = _state.sets.engine_for(process_set, what)
            if root is not None:
                kwargs["root"] = _state.sets.root_in(process_set, root, what)
    if engine is not None:
        return engine.submit(kind, arrays, **kwargs)
    return _one_rank_job().submit(kind, arrays, **kwargs)


def check_process_set(process_set, what: str) -> None:
    """ValueError (``submit``'s) now when the engine runs and ``process_set`` is not registered: for an adapter
    whose collective runs later (a TensorFlow graph), as Horovod raises it when the op is made."""
    if _state.sets is not None and process_set is not None:
        _state.sets.check_registered(process_set, what)
    elif _state.initialized and _state.engine is None:
        _one_rank_sets(process_set, what)


def engine_for(process_set=None, what: str = "DistributedOptimizer"):
    """The engine that runs ``process_set`` on this rank (None when switched off): for adapters
    whose objects (gradient buckets) live on one engine. ``what`` names the caller in errors."""
    engine = _need("engine_for")
    if engine is None or process_set is None:
        if engine is None and process_set is not None:
            _one_rank_sets(process_set, what)
        return engine
    return _state.sets.engine_for(process_set, what)


def switched_off(what: str) -> bool:
    """Whether an adapter's wrapper (``what``: ``"DistributedOptimizer"``, ...) hands back the framework's own
    object: True while aiacc is switched off (``AIACC_ENABLE`` unset or 0), also before ``init()``, so a
    script runs unchanged without ``aiaccrun``; False once ``init()`` has started the engine. Switched on
    but not initialised: NotInitializedError naming ``what``. The one test of "switched off" of every
    adapter."""
    if _state.initialized:
        return _state.engine is None
    if not _config.from_env().enable:
        return True
    raise NotInitializedError(f"{what} was created before init(); call init() first")


class GradientEngine(NamedTuple):
    """Where a gradient wrapper (``DistributedOptimizer``, ``DistributedTrainer``, ``DistributedGradientTape``)
    reduces: see :func:`gradient_engine`."""

    engine: object  # the engine of the process set; None: switched off, or outside the set
    outside: bool  # this rank is outside the process set: it trains on its own gradients (Horovod's behaviour)

    @property
    def off(self) -> bool:
        """Switched off: the wrapper hands back the framework's own object."""
        return self.engine is None and not self.outside


def gradient_engine(process_set, what: str) -> GradientEngine:
    """The engine a gradient wrapper ``what`` reduces on, for ``process_set`` (None or the global set: every
    rank): ``GradientEngine(None, False)`` when switched off (see :func:`switched_off`), ``(None, True)`` on
    a rank outside the set, else the set's engine. A set that is not registered is an error naming it, in
    every mode."""
    if switched_off(what):
        if _state.initialized:
            engine_for(process_set, what)  # the only sets of a job of one rank hold rank 0: checked
        return GradientEngine(None, False)
    if outside_process_set(process_set):
        return GradientEngine(None, True)
    return GradientEngine(engine_for(process_set, what), False)


def _registered(process_set):
    """``process_set`` (None: the global set) once it is registered; an error naming it otherwise."""
    from .process_sets import global_process_set  # noqa: PLC0415

    if process_set is None:
        return global_process_set
    if getattr(process_set, "process_set_id", None) is None:
        raise InvalidArgumentError(f"{process_set!r} is not a registered process set; add it with "
                                   "add_process_set (or init(process_sets=...)) first")
    return process_set


def set_size(process_set=None) -> int:
    """The number of ranks of ``process_set`` (None or the global set: the job's ``size()``)."""
    _need("set_size")
    return _registered(process_set).size()


def set_rank(process_set=None) -> int:
    """This rank's position in ``process_set`` (the job's ``rank()`` for the global set); ValueError when
    this rank is not in the set."""
    _need("set_rank")
    return _registered(process_set).rank()


def check_root(root_rank, what: str, process_set=None) -> int:
    """``root_rank`` as an int when it is a rank of the job (and of ``process_set``): the check of every
    broadcast, in every adapter, with one message naming ``what``. Roots are ranks of the job, also with a
    process set (Horovod's rule)."""
    _need("check_root", what)
    root = check_root_rank(root_rank, size(), what)
    from .process_sets import global_process_set  # noqa: PLC0415

    if process_set is not None and process_set is not global_process_set \
            and getattr(process_set, "process_set_id", None) is not None and root not in process_set.ranks:
        raise InvalidArgumentError(f"{what}: root_rank={root} is not in process set {process_set.process_set_id} "
                                   f"(ranks {process_set.ranks})")
    return root


def job_comm():
    """A new mpi4py communicator of the job's ranks, apart from the engine's (collective: every rank calls
    it); None when switched off. For an adapter's own point-to-point messages."""
    engine = _need("job_comm")
    return None if engine is None else engine.base_comm.Dup()


def outside_process_set(process_set) -> bool:
    """True when ``process_set`` is registered and this rank is not in it. Horovod's
    ``DistributedOptimizer`` (``DistributedTrainer`` in MXNet) skips the reduction on such a rank, which
    trains on its own gradients; ``engine_for`` refuses the set there. An unregistered set is not
    "outside": ``engine_for`` names the mistake."""
    from .process_sets import global_process_set  # noqa: PLC0415

    return (process_set is not None and process_set is not global_process_set
            and getattr(process_set, "process_set_id", None) is not None and process_set.included() is False)


def _one_rank_sets(process_set, what: str = "init") -> None:
    """Switched off, the job has one rank, as under ``aiaccrun -np 1``: its only process set is the global one
    (a set of rank 0 repeats it, and no other can be made), so any other is the error of a set not registered."""
    from .process_sets import global_process_set  # noqa: PLC0415

    if process_set is None or process_set is global_process_set:
        return
    raise ValueError(f"{what}: {process_set!r} is not a registered process set; add it with add_process_set "
                     "(or init(process_sets=...)) first")


def _one_rank_init_sets(process_sets) -> None:
    """``init(process_sets=...)`` switched off: what ``ProcessSetTable.add_at_init`` says in a job of one rank,
    where every set (of rank 0, or a communicator of this process) repeats the global set."""
    from .process_sets import ProcessSet, check_ranks, repeat_entry, repeats_error  # noqa: PLC0415

    repeats = []
    for i, ps in enumerate(process_sets):
        ps = ps if isinstance(ps, ProcessSet) else ProcessSet(ps)
        ranks = [0] if ps.ranks is None else list(ps.ranks)
        check_ranks(ranks, 1)
        repeats.append(repeat_entry(i, ps, ranks))
    raise repeats_error(0, repeats)


def process_set_by_id(process_set_id: int):
    """The registered process set with this id (0: the global set); ValueError for an unknown id. Horovod's
    ops that take a ``process_set_id`` (``size_op``, ...) look sets up by it."""
    from .process_sets import global_process_set  # noqa: PLC0415

    _need("process_set_by_id")
    if int(process_set_id) == 0:
        return global_process_set
    found = None if _state.sets is None else _state.sets.sets.get(int(process_set_id))
    if found is None:
        raise ValueError(f"process_set_id={process_set_id} is not a registered process set")
    return found


def add_process_set(process_set):
    """Register a process set (a ProcessSet or a list of ranks) on every rank; collective."""
    engine = _need("add_process_set")
    _need_dynamic_sets("adding")
    if engine is None:  # a job of one rank (aiaccrun -np 1's errors): rank 0 is the global set already
        from .process_sets import check_ranks, duplicate_error, new_set  # noqa: PLC0415

        ranks = list(new_set(process_set).ranks)
        check_ranks(ranks, 1)
        raise duplicate_error(ranks)  # (the only ranks that pass: the global set's)
    return _state.sets.add(process_set)


def remove_process_set(process_set) -> bool:
    """Unregister a process set on every rank; collective. False for the global set."""
    engine = _need("remove_process_set")
    _need_dynamic_sets("removing")
    if engine is None:  # (a job of one rank has no set but the global one, which is not removed)
        from .process_sets import not_a_set  # noqa: PLC0415

        not_a_set(process_set)
        return False
    return _state.sets.remove(process_set)


def add_members_only_set(ranks, tag: int = 0, timeout: Optional[float] = None, what: str = "make the process set"):
    """Register a process set of ``ranks`` on its members alone: collective over them, the other ranks call
    nothing (``ProcessSetTable.add_members_only``; torch's sub-groups). ``tag``: the same on every member.
    ``timeout`` (seconds): a member not there within it is a MembersMissingError naming it (``what``: what the
    members call), not a wait for ever."""
    engine = _need("add_members_only_set")
    if engine is None:
        raise ValueError(f"a process set of ranks {list(ranks)}: aiacc is switched off (a job of one rank)")
    return _state.sets.add_members_only(ranks, tag, timeout, what)


def missing_ranks(name: str, process_set=None, wait: float = 5.0):
    """For a wait on the operation ``name`` that timed out: ``(have, missing)``, the ranks (of the job) that have
    submitted it and those that have not, from a collective stall report of the engine of ``process_set``
    (``Engine.missing_ranks``); ``([], [])`` when every rank has submitted it; None when unknown (no report
    within ``wait`` seconds, or aiacc switched off or stopped)."""
    if not _state.initialized or _state.engine is None:
        return None
    try:
        engine = engine_for(process_set, "missing_ranks")
    except (ValueError, AiaccError):  # (the set was removed meanwhile)
        return None
    return engine.missing_ranks(name, wait)


def remove_members_only_set(process_set, reason: Optional[str] = None) -> bool:
    """Stop a set of ``add_members_only_set`` on this rank (its other members' engines stop with it: what they
    submit after it fails naming ``reason``); False when it is not one. Not collective."""
    if _state.sets is None:
        return False
    return _state.sets.remove_members_only(process_set, reason)


def _need_dynamic_sets(doing: str) -> None:
    """Horovod's static process sets (``HOROVOD_DYNAMIC_PROCESS_SETS=0``, set explicitly: aiacc's default is
    dynamic): only ``init(process_sets=[...])`` registers sets, on every rank alike (the setting must agree)."""
    cfg = _state.config
    if cfg is None or cfg.dynamic_process_sets or _state.dynamic_sets:
        return
    var = cfg.variable("dynamic_process_sets")
    raise ValueError(f"{var} is off: {doing} process sets after init() is not allowed (static process sets, "
                     f"Horovod's default); set {var}=1 or call init(process_sets=\"dynamic\") to allow adding and removing them")


def _one_rank_job():
    job = _state.local
    if job is None:
        from .local import OneRankJob  # noqa: PLC0415

        job = _state.local = OneRankJob()
    return job


# ---- collectives on numpy arrays -------------------------------------------------------
# Every collective takes ``process_set`` (default: every rank of the job) and ``name`` (matches the
# operation across ranks; unnamed ones are matched by call order).

def _single(array, kind: str = "allreduce", name: Optional[str] = None):
    """The argument of a one-tensor collective as numpy reads it: a list or tuple of numbers is one array
    (grouped calls are the ones that take a list of arrays). One that numpy cannot make an array of (arrays of
    different shapes) is a ValueError naming the call and the tensor."""
    if array.__class__ is not list and array.__class__ is not tuple:
        return array
    try:
        return np.asarray(array)
    except ValueError as exc:
        grouped = f"; to reduce or gather several arrays, pass the list to grouped_{kind}" \
            if kind in ("allreduce", "allgather", "reducescatter") else ""
        raise ValueError(f"{kind} of tensor {name or '(unnamed)'!r}: a list of arrays of different shapes is not one "
                         f"array (numpy: {exc}){grouped}") from None


def as_group(arrays, fn: str, name: Optional[str], noun: Optional[str] = None) -> list:
    """The list of arrays (an adapter's tensors) of a grouped call ``fn``; one array or tensor is refused (it was
    taken as the list of its rows: each row reduced or gathered alone, in every adapter)."""
    if hasattr(arrays, "shape") and hasattr(arrays, "dtype"):
        noun = noun or ("array" if type(arrays).__module__.startswith("numpy") else "tensor")
        raise TypeError(f"{fn} of {name or '(unnamed)'!r} takes a list of {noun}s, not one {noun} (shape "
                        f"{tuple(arrays.shape)}); for one {noun} call {fn.replace('grouped_', '')}({noun}), or pass "
                        f"[{noun}]")
    return list(arrays)


def allreduce_async(array, op=Average, name: Optional[str] = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, compression=None, priority: float = 0.0, process_set=None):
    """Start reducing ``array`` across ranks; ``synchronize`` the handle for the result."""
    return submit_allreduce(_single(array, "allreduce", name), name, op, prescale_factor, postscale_factor, compression,
                            priority, None, process_set)


def allreduce(array, op=Average, name: Optional[str] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, compression=None, priority: float = 0.0,
              process_set=None) -> np.ndarray:
    """``array`` reduced across ranks with ``op`` (Average, Sum, Min, Max, Product); a new array."""
    return submit_allreduce(_single(array, "allreduce", name), name, op, prescale_factor, postscale_factor, compression,
                            priority, None, process_set, False).wait()


def grouped_allreduce_async(arrays: Sequence, op=Average, name: Optional[str] = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, compression=None, priority: float = 0.0,
                            process_set=None):
    """Start reducing a list of arrays as one unit (agreed and completed together)."""
    return submit(Collective.ALLREDUCE, as_group(arrays, "grouped_allreduce", name), name=name, op=op,
                  prescale=prescale_factor, postscale=postscale_factor, compression=compression, priority=priority,
                  process_set=process_set)


def grouped_allreduce(arrays: Sequence, op=Average, name: Optional[str] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, compression=None, priority: float = 0.0,
                      process_set=None) -> List[np.ndarray]:
    return grouped_allreduce_async(arrays, op, name, prescale_factor, postscale_factor, compression, priority,
                                   process_set).wait()


def allreduce_async_(array, op=Average, name: Optional[str] = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, compression=None, priority: float = 0.0, process_set=None):
    """Start reducing ``array`` across ranks in place; ``synchronize`` the handle for ``array`` itself."""
    engine = _state.engine
    if engine is not None and process_set is None:  # (submit_allreduce's first branch: a call less per tensor)
        return engine.submit_allreduce(array, name, op, prescale_factor, postscale_factor, compression, priority,
                                       [array])
    return submit_allreduce(array, name, op, prescale_factor, postscale_factor, compression, priority, [array],
                            process_set)


def allreduce_(array, op=Average, name: Optional[str] = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, compression=None, priority: float = 0.0,
               process_set=None) -> np.ndarray:
    """Reduce ``array`` across ranks in place (no copy of its data is made) and return it."""
    return submit_allreduce(array, name, op, prescale_factor, postscale_factor, compression, priority, [array],
                            process_set, False).wait()


def grouped_allreduce_async_(arrays: Sequence, op=Average, name: Optional[str] = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, compression=None, priority: float = 0.0,
                             process_set=None):
    """Start reducing a list of arrays in place, as one unit."""
    arrays = as_group(arrays, "grouped_allreduce_", name)
    return submit(Collective.ALLREDUCE, arrays, name=name, op=op, prescale=prescale_factor,
                  postscale=postscale_factor, compression=compression, priority=priority, outputs=arrays,
                  process_set=process_set)


def grouped_allreduce_(arrays: Sequence, op=Average, name: Optional[str] = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, compression=None, priority: float = 0.0,
                       process_set=None) -> List[np.ndarray]:
    """Reduce a list of arrays in place, as one unit; returns the same arrays."""
    return grouped_allreduce_async_(arrays, op, name, prescale_factor, postscale_factor, compression, priority,
                                    process_set).wait()


def allgather_async(array, name: Optional[str] = None, process_set=None):
    return submit(Collective.ALLGATHER, _single(array, "allgather", name), name=name, process_set=process_set)


def allgather(array, name: Optional[str] = None, process_set=None) -> np.ndarray:
    """Concatenation along the first dimension of every rank's ``array`` (first dimensions may differ)."""
    return allgather_async(array, name, process_set).wait()


def grouped_allgather_async(arrays: Sequence, name: Optional[str] = None, process_set=None):
    """Start gathering a list of arrays as one unit (agreed and completed together)."""
    return submit(Collective.ALLGATHER, as_group(arrays, "grouped_allgather", name), name=name, process_set=process_set)


def grouped_allgather(arrays: Sequence, name: Optional[str] = None, process_set=None) -> List[np.ndarray]:
    """``allgather`` of each array of the list, as one unit."""
    return grouped_allgather_async(arrays, name, process_set).wait()


def broadcast_async(array, root_rank: int, name: Optional[str] = None, process_set=None):
    return submit(Collective.BROADCAST, _single(array, "broadcast", name), name=name, root=root_rank,
                  process_set=process_set)


def broadcast(array, root_rank: int, name: Optional[str] = None, process_set=None) -> np.ndarray:
    """``root_rank``'s ``array`` on every rank (a new array); ``root_rank`` is a rank of the job."""
    return broadcast_async(array, root_rank, name, process_set).wait()


def alltoall_async(array, splits=None, name: Optional[str] = None, process_set=None):
    return submit(Collective.ALLTOALL, _single(array, "alltoall", name), name=name, splits=splits,
                  process_set=process_set)


def alltoall(array, splits=None, name: Optional[str] = None, process_set=None):
    """Send ``splits[i]`` rows of ``array`` to rank i (equal parts if None).

    Returns the received rows; with ``splits`` given, returns ``(rows, received_splits)`` as Horovod does.
    """
    out, received = alltoall_async(array, splits, name, process_set).wait()
    return out if splits is None else (out, received)


def reducescatter_async(array, op=Average, name: Optional[str] = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, compression=None, process_set=None):
    return submit(Collective.REDUCESCATTER, _single(array, "reducescatter", name), name=name, op=op,
                  prescale=prescale_factor, postscale=postscale_factor, compression=compression,
                  process_set=process_set)


def reducescatter(array, op=Average, name: Optional[str] = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, compression=None, process_set=None) -> np.ndarray:
    """Reduce ``array`` across ranks; rank i keeps the i-th block of rows (the first ``n % size`` ranks one
    more). ``compression`` casts on the wire, as for allreduce."""
    return reducescatter_async(array, op, name, prescale_factor, postscale_factor, compression, process_set).wait()


def grouped_reducescatter_async(arrays: Sequence, op=Average, name: Optional[str] = None,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0, compression=None,
                                process_set=None):
    """Start reducing and scattering a list of arrays as one unit."""
    return submit(Collective.REDUCESCATTER, as_group(arrays, "grouped_reducescatter", name), name=name, op=op,
                  prescale=prescale_factor, postscale=postscale_factor, compression=compression,
                  process_set=process_set)


def grouped_reducescatter(arrays: Sequence, op=Average, name: Optional[str] = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0, compression=None, process_set=None) -> List[np.ndarray]:
    """``reducescatter`` of each array of the list, as one unit."""
    return grouped_reducescatter_async(arrays, op, name, prescale_factor, postscale_factor, compression,
                                       process_set).wait()


def barrier(process_set=None) -> None:
    """Wait until every rank has called barrier()."""
    submit(Collective.BARRIER, [], name=None, process_set=process_set).wait()


def join() -> int:
    """Tell the other ranks this rank has no more data (Horovod's ``join``).

    Until every rank has joined, this rank takes part in the others' allreduces with the identity
    of their op (zeros for Sum and Average, ones for Product, the dtype's extreme for Min and Max);
    ``Average`` still divides by the job's size, as in Horovod. Other collectives fail on every
    rank while a rank has joined. Returns the rank that joined last.
    """
    from .negotiation import JOIN_NAME  # noqa: PLC0415

    last = submit(Collective.JOIN, [], name=JOIN_NAME).wait()
    _state.joined = True
    return last


def has_joined() -> bool:
    """Whether ``join()`` has returned on this rank: from there on, a step's number differs across ranks (an uneven
    epoch), so checks made at some step of each rank's own (the same start, at the second) are no longer collective."""
    return _state.joined


__all__ += ["ReduceOp"]
