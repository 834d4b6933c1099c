"""Process sets: collectives among a subset of the ranks (Horovod's API).

A process set this rank belongs to runs on an engine of its own: an MPI
communicator of its members (split from the job's), its own negotiation and
response cache, its own thread. So the sets never wait for each other, and a
rank takes part only in the sets it is in. The global set is the job's
engine. Adding and removing a set is collective over every rank of the job,
as in Horovod (where it needs ``HOROVOD_DYNAMIC_PROCESS_SETS=1``; here it
works unless that, or ``AIACC_DYNAMIC_PROCESS_SETS``, is 0: see
``aiacc.api.add_process_set``); sets passed to ``init(process_sets=...)`` are added there.

A set of its members only (``add_members_only``, for torch.distributed's
sub-groups, whose backend torch builds on their members alone) is registered by
its members without the other ranks: its communicator comes from
``MPI_Comm_create_group`` over the members, and it has no id in the job's table.

Ranks are always the job's ranks: ``broadcast(..., root_rank, process_set=s)``
takes the root's global rank, as Horovod's does; results of allgather and
reducescatter follow the order of the set's ranks.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import numbers
import threading
import time
import zlib
from typing import Dict, List, Optional

import numpy as np

from .exceptions import AiaccError, InvalidArgumentError, MembersMissingError, StallError
from .timeline import DYNAMIC_TIMELINE

logger = logging.getLogger(__name__)

__all__ = ["ProcessSet", "ProcessSetTable", "global_process_set", "HorovodBasics"]


class ProcessSet:
    """A set of ranks that run collectives together: ``ProcessSet([0, 2])`` (ranks of the job), or
    ``ProcessSet(comm)`` for an mpi4py communicator whose processes are ranks of the job (each rank passes
    its own: the even ranks their half of a ``Split``, the odd ones theirs). Pass it to
    ``init(process_sets=[...])`` or (ranks only) ``add_process_set``; ``process_set_id`` and, for a
    communicator, ``ranks`` are set once it is registered."""

    def __init__(self, ranks_or_comm):
        self.process_set_id: Optional[int] = None
        self.mpi_comm = None
        self.ranks: Optional[List[int]] = None
        if hasattr(ranks_or_comm, "Get_group"):
            self.mpi_comm = ranks_or_comm
            return
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet takes a list of ranks or an mpi4py communicator, not "
                             f"{type(ranks_or_comm).__name__}") from None
        bad = [r for r in ranks if isinstance(r, (bool, np.bool_)) or not isinstance(r, numbers.Integral)]
        if bad:  # (numpy's integers are whole numbers: np.arange(0, n, 2) is a set of ranks)
            raise ValueError(f"ProcessSet ranks must be whole numbers, got {ranks!r} (not: "
                             f"{', '.join(f'{r!r} ({type(r).__name__})' for r in bad)})")
        self.ranks = [int(r) for r in ranks]

    def size(self) -> Optional[int]:
        """The number of ranks in the set (None until registered)."""
        if self.process_set_id == 0:
            _job_running("size")
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> Optional[int]:
        """This rank's position in the set (None until registered); ValueError when this rank is not in
        it (Horovod's)."""
        if self.process_set_id is None:
            return None
        if self.process_set_id == 0:
            _job_running("rank")
        me = _table_rank()
        if me not in self.ranks:
            raise ValueError(f"rank {me} is not in process set {self.process_set_id} (ranks {self.ranks}): "
                             "Process is not part of provided process set.")
        return self.ranks.index(me)

    def included(self) -> Optional[bool]:
        """Whether this rank belongs to the set (None before the ranks are known)."""
        if self.ranks is None:
            return None
        if self.process_set_id == 0:
            _job_running("included")
        return _table_rank() in self.ranks

    def __repr__(self) -> str:  # (Horovod's text, which its tests compare)
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

_current: Optional["ProcessSetTable"] = None

_ARRIVED = b"\x01"  # what a rank sends every other one when it calls a registration (ProcessSetTable._everyone)
_ARRIVAL_TAG = 7  # (the table's communicator is its own: no other message uses it)


def _ranks_named(ranks: List[int]) -> str:
    """``"rank 1"``, ``"ranks 1, 2"``, ``"ranks 0, 1, 2, ... (40 ranks)"``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(map(str, ranks[:8]))
    return f"ranks {shown}" + (f", ... ({len(ranks)} ranks)" if len(ranks) > 8 else "")


def _job_running(what: str) -> None:
    """NotInitializedError unless aiacc runs: the global set answered 0 ranks before ``init()``, and after
    ``shutdown()`` ``rank()`` 0 on every rank (``if global_process_set.rank() == 0: save()`` ran on all of them)."""
    from . import api  # noqa: PLC0415

    api._need(f"global_process_set.{what}")


def _table_rank() -> int:
    return _current.rank if _current is not None else 0


# ---- Horovod's checks and messages for sets being added (ProcessSetTable's, and the job of one rank's) ---------
def new_set(process_set) -> ProcessSet:
    """``add_process_set``'s argument as a ProcessSet of ranks not registered yet (checked on the calling rank)."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set} is registered already")
    if process_set.ranks is None:  # (Horovod's add_process_set refuses them too)
        raise NotImplementedError("add_process_set takes a ProcessSet of ranks; one made from an MPI "
                                  "communicator can be registered by init(process_sets=[...]), or pass its ranks")
    return process_set


def check_ranks(ranks: List[int], size: int) -> None:
    if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < size for r in ranks):
        raise ValueError(f"a process set needs distinct ranks in 0..{size - 1}, got {ranks}")


def duplicate_error(ranks: List[int]) -> ValueError:
    return ValueError(f"Attempted to add a duplicate process set: ranks {ranks} form a set already")


def repeat_entry(i: int, process_set: ProcessSet, ranks: List[int]) -> str:
    """How ``init(process_sets=...)``'s error names entry ``i``, which repeats a set registered already."""
    return f"entry {i} ({process_set.mpi_comm if process_set.ranks is None else ranks}: ranks {ranks})"


def repeats_error(rank: int, repeats: List[str]) -> ValueError:
    return ValueError(f"init(process_sets=...) on rank {rank}: {', '.join(repeats)} repeats an earlier entry or the "
                      "global set (all ranks); the other sets are registered, call init again with a list without the "
                      "repeats")


def not_a_set(process_set) -> None:
    """TypeError unless ``process_set`` is a ProcessSet (``remove_process_set([0, 1])`` returned False and left the
    set registered: the next ``add_process_set([0, 1])`` was then refused as a duplicate)."""
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"remove_process_set takes the ProcessSet that add_process_set returned (or that was passed "
                        f"to init), got {type(process_set).__name__} {process_set!r}")


class ProcessSetTable:
    """The registered sets of this process and their engines (one table per ``init``)."""

    def __init__(self, comm, config, global_engine, rank: int, size: int, make_engine):
        global _current
        self.comm = comm  # a private duplicate of the job's communicator, for adding and removing sets
        self.config = config
        # the timeline new sets' engines write: the configured one until start_timeline / stop_timeline changes it
        self.timeline = (config.timeline, config.timeline_mark_cycles)
        self.rank, self.size = rank, size
        self._make_engine = make_engine
        self._lock = threading.Lock()
        self._next_id = 1
        self._free_ids: "collections.deque[int]" = collections.deque()  # removed sets' ids, reused first (Horovod)
        self.sets: Dict[int, ProcessSet] = {0: global_process_set}
        self.engines: Dict[int, object] = {0: global_engine}
        # every ProcessSet object given each id (the table's own and those of init(process_sets=...)'s entries):
        # all of them let the id go when the set is removed or the table shut down (an object that kept it would
        # run its collectives on whichever set gets the id next)
        self._holders: Dict[int, List[ProcessSet]] = {}
        self.member_sets: Dict[int, ProcessSet] = {}  # sets of their members only, by this rank's negative ids
        self._next_member_id = -1
        self._stalled: Optional[str] = None  # a registration some rank never joined (see _everyone)
        global_process_set.ranks = list(range(size))
        _current = self

    # ---- registration (collective over every rank of the job) ------------------------------
    def _need_thread_multiple(self, what: str) -> None:
        """Refuse a new set (on every rank alike, before any MPI call) when MPI runs below MPI_THREAD_MULTIPLE:
        each set's engine calls MPI from a thread of its own, beside the global engine's thread (Horovod runs
        every set on its one background thread)."""
        if not getattr(self.engines[0], "mpi_thread_multiple", True):
            raise AiaccError(f"{what}: MPI runs below MPI_THREAD_MULTIPLE (the script started it before "
                             "aiacc.init(), e.g. mpi4py.rc.thread_level = 'serialized'); aiacc's process sets need "
                             "MPI_THREAD_MULTIPLE, as each set's engine calls MPI from its own thread: let "
                             "aiacc.init() start MPI, or set mpi4py.rc.thread_level = 'multiple'")

    def _everyone(self, obj, what: str) -> list:
        """Every rank's ``obj`` (an allgather on the table's communicator) once every rank has called a registration
        too: first each rank tells every other one it has arrived (a one-byte message each: a barrier that can say
        who is missing), waited for up to the stall shutdown (warned at the stall check), then a StallError on this
        rank naming the ranks that never called. A rank that never called ``add_process_set`` (or
        ``remove_process_set``) left the others in the allgather for ever, also past the stall shutdown, which
        watches the engines. After it no registration can be agreed any more: later ones raise the same error."""
        from mpi4py import MPI  # noqa: PLC0415

        if self._stalled is not None:
            raise StallError(self._stalled)
        others = [k for k in range(self.size) if k != self.rank]
        sends = [self.comm.Isend(_ARRIVED, dest=k, tag=_ARRIVAL_TAG) for k in others]
        inbox = bytearray(len(others))
        arrivals = [self.comm.Irecv(memoryview(inbox)[i:i + 1], source=k, tag=_ARRIVAL_TAG)
                    for i, k in enumerate(others)]
        start = time.monotonic()
        check, limit = self.config.stall_check_seconds, self.config.stall_shutdown_seconds
        warned, pause = False, 1e-4
        while not MPI.Request.Testall(arrivals):
            waited = time.monotonic() - start
            if limit and waited > limit:
                missing = [k for k, req in zip(others, arrivals) if not req.Test()]
                for req in arrivals:
                    if req:
                        req.Cancel()
                        req.Wait()
                self._stalled = (
                    f"{what} on rank {self.rank} waited {waited:.0f} s for every rank of the job to register or remove "
                    f"a process set too, and {_ranks_named(missing)} did not (AIACC_STALL_SHUTDOWN_SECONDS): "
                    "add_process_set, remove_process_set and init(process_sets=...) are collective over every rank "
                    "of the job, with the same sets in the same order; no set can be added or removed in this job "
                    "any more")
                raise StallError(self._stalled)
            if check and not warned and waited > check:
                missing = [k for k, req in zip(others, arrivals) if not req.Test()]
                logger.warning("aiacc: %s on rank %d has waited %.0f s for %s to call it too (collective over the "
                               "whole job); ending at the stall shutdown (%g s)", what, self.rank, waited,
                               _ranks_named(missing), limit)
                warned = True
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
        MPI.Request.Waitall(sends)
        return self.comm.allgather(obj)

    def add(self, process_set) -> ProcessSet:
        process_set = new_set(process_set)
        self._need_thread_multiple("add_process_set")
        ranks = list(process_set.ranks)
        with self._lock:
            everyone = self._everyone(tuple(ranks), "add_process_set")
            if any(r != everyone[0] for r in everyone):
                detail = "; ".join(f"rank {k}: {list(r)}" for k, r in enumerate(everyone))
                raise ValueError(f"add_process_set was called with different ranks on different ranks ({detail}); "
                                 "every rank must add the same sets in the same order")
            check_ranks(ranks, self.size)
            if self._id_of(ranks) is not None:
                raise duplicate_error(ranks)
            self._register(ranks, process_set)
        return process_set

    def add_at_init(self, process_sets) -> None:
        """``init(process_sets=[...])`` with Horovod's rules (collective over every rank of the job).

        Each rank passes its own list. Sets of ranks are the same on every rank; a set made from an
        mpi4py communicator is that rank's communicator, so ranks in different halves of a ``Split``
        pass different ones. Every distinct set that is not registered yet is registered once, the same
        way on every rank, in Horovod's order: those from communicators first (by position in the
        lists; at one position, every rank's set in sorted order), then those of ranks, in list order.
        Then each entry of this rank's list gets its set's id. An entry that repeats an earlier entry or
        the global set raises ValueError, after the others are registered (as in Horovod: the job stays
        initialized, and ``init`` with a list without the repeat then succeeds; a later ``init`` with
        sets registers those that are new, collectively again).
        """
        entries = [ps if isinstance(ps, ProcessSet) else ProcessSet(ps) for ps in process_sets]
        if entries:
            self._need_thread_multiple("init(process_sets=...)")
        try:
            mine = [(ps.ranks is None, tuple(self._ranks_of(ps))) for ps in entries]
            problem = None
        except ValueError as exc:  # reported on every rank below, not just here (the others would hang)
            mine, problem = [], str(exc)
        with self._lock:
            everyone = self._everyone((problem, mine), "init(process_sets=...)")
            failed = [(r, p) for r, (p, _) in enumerate(everyone) if p is not None]
            if failed:
                raise ValueError("init(process_sets=...): " + "; ".join(f"rank {r}: {p}" for r, p in failed))
            by_ranks = [[ranks for from_comm, ranks in lst if not from_comm] for _, lst in everyone]
            if any(b != by_ranks[0] for b in by_ranks):
                detail = "; ".join(f"rank {r}: {[list(x) for x in b]}" for r, b in enumerate(by_ranks))
                raise ValueError(f"init(process_sets=...): the process sets given as ranks differ across ranks "
                                 f"({detail}); every rank must pass the same ones in the same order (only sets "
                                 "made from MPI communicators may differ)")
            by_comm = [[ranks for from_comm, ranks in lst if from_comm] for _, lst in everyone]
            order = [ranks for i in range(max(map(len, by_comm), default=0))
                     for ranks in sorted({lst[i] for lst in by_comm if i < len(lst)})]
            order += by_ranks[0]
            for ranks in order:
                check_ranks(list(ranks), self.size)
            for ranks in order:
                if self._id_of(list(ranks)) is None:
                    self._register(list(ranks), ProcessSet(list(ranks)))
        seen, repeats = {0}, []
        for i, (ps, (_, ranks)) in enumerate(zip(entries, mine)):
            set_id = self._id_of(list(ranks))
            if set_id in seen:
                ps.process_set_id = None
                repeats.append(repeat_entry(i, ps, list(ranks)))
                continue
            seen.add(set_id)
            ps.ranks, ps.process_set_id = list(ranks), set_id
            holders = self._holders.setdefault(set_id, [])
            if not any(h is ps for h in holders):
                holders.append(ps)
        if repeats:
            raise repeats_error(self.rank, repeats)

    def _register(self, ranks: List[int], process_set: ProcessSet) -> None:
        """A new set (the caller holds the lock, and every rank registers the same sets in the same order):
        its engine on its members, from a ``Split`` of the job's communicator."""
        from .transport.mpi import import_mpi  # noqa: PLC0415

        MPI = import_mpi()
        sub = self.comm.Split(0 if self.rank in ranks else MPI.UNDEFINED, key=self.rank)
        if self._free_ids:
            set_id = self._free_ids.popleft()
        else:
            set_id = self._next_id
            self._next_id += 1
        if sub != MPI.COMM_NULL:
            try:
                self.engines[set_id] = self._make_engine(self._config_for(set_id), sub, ranks)
            finally:
                sub.Free()
        process_set.ranks = ranks
        process_set.process_set_id = set_id
        self.sets[set_id] = process_set
        self._holders[set_id] = [process_set]

    # ---- sets of their members only (collective over the set's ranks, not the job's) -------
    def add_members_only(self, ranks, tag: int = 0, timeout: Optional[float] = None,
                         what: str = "make the process set") -> ProcessSet:
        """A set registered by its members alone, for ``torch.distributed``'s sub-groups (torch builds a group's
        backend on its members only: the other ranks never call anything). Its communicator is made by
        ``MPI_Comm_create_group`` over the members, which is collective over them alone; its engine, like any
        set's, negotiates among them. It has no id in the job's table (the ranks register such sets each in
        its own order, so an id would differ across ranks): a negative id of this rank's, which
        ``add_process_set``, ``ids_and_ranks`` and ``process_set_by_id`` do not see; ``submit`` and the
        adapters' collectives take the set as any other. ``tag`` (the same on every member) tells apart
        creations that may overlap in time on different ranks. ``mpi_comm``: a communicator of the members for
        the caller (point-to-point), freed when the set is removed. Remove it with ``remove_members_only``.

        ``timeout`` (seconds; None: none): ``MPI_Comm_create_group`` waits for every member for ever, so the
        members first meet over point-to-point messages (``_meet``) and call it only once all of them are there;
        a member that is not there within the timeout makes the others raise :class:`MembersMissingError`
        naming it (``what``: what the members call, for the message), with nothing made."""
        ranks = sorted(int(r) for r in ranks)
        check_ranks(ranks, self.size)
        if self.rank not in ranks:
            raise ValueError(f"a process set of its members only is registered by its members: rank {self.rank} "
                             f"is not one of {ranks}")
        self._need_thread_multiple(f"process set of ranks {ranks}")
        if timeout is not None:
            self._meet(ranks, tag, timeout, what)
        job = self.comm.Get_group()
        try:
            members = job.Incl(ranks)
        finally:
            job.Free()
        with self._lock:  # (the table's communicator: one MPI call on it at a time in this process)
            try:
                sub = self.comm.Create_group(members, tag)
            finally:
                members.Free()
            set_id = self._next_member_id
            self._next_member_id -= 1
        try:
            engine = self._make_engine(self._config_for(set_id), sub, ranks)
        except BaseException:
            sub.Free()
            raise
        process_set = ProcessSet(ranks)
        process_set.process_set_id, process_set.mpi_comm = set_id, sub
        with self._lock:
            self.member_sets[set_id] = process_set
            self.engines[set_id] = engine
            self._holders[set_id] = [process_set]
        return process_set

    def _meet(self, ranks: List[int], tag: int, timeout: float, what: str) -> None:
        """Return once every member of ``ranks`` has come to make their set, so that ``MPI_Comm_create_group``
        (which waits for every member for ever) returns; else :class:`MembersMissingError` naming the members
        that did not come within ``timeout`` seconds.

        Each member sends every other one a note (on the table's communicator, under a tag of ``tag``'s): the
        wall-clock time it came and the time its timeout ends. A member waits for every other's note until its
        own timeout ends (looking at its receives with growing sleeps between looks: MPI has no wait with a
        deadline). With every note in, each member takes the same decision from the same notes: go on when the
        last of them came at least ``margin`` before the earliest end of a timeout, else raise (they came too
        late for one another). A member that gives up at its own timeout's end has missed a note; a note sent
        ``margin`` before that end would have reached it (messages take less, clocks differ less), so every
        member that got all notes raises too, and none waits in ``MPI_Comm_create_group`` for it. A note whose
        sender's timeout ended (within ``margin``) is one from a member that gave up (an earlier try): it does
        not count, and the message says so."""
        from .transport.mpi import import_mpi  # noqa: PLC0415

        MPI = import_mpi()
        others = [r for r in ranks if r != self.rank]
        came = time.time()
        ends = came + timeout
        margin = min(1.0, 0.25 * timeout)
        if not others:
            return
        top = self.comm.Get_attr(MPI.TAG_UB) or 32767
        note_tag = (1 << 15) + tag if top >= (1 << 16) else tag  # (apart from MPI_Comm_create_group's own tag)
        key = float(zlib.crc32(repr(ranks).encode()))  # (notes of another set under the same tag do not count)
        mine = np.array([came, ends, key], dtype=np.float64)
        sends = [self.comm.Isend(mine, dest=r, tag=note_tag) for r in others]
        notes = {r: np.zeros(3, dtype=np.float64) for r in others}
        recvs = {r: self.comm.Irecv(notes[r], source=r, tag=note_tag) for r in others}
        got, gave_up = {}, {}
        nap = 1e-3
        try:
            while recvs:
                for r, req in list(recvs.items()):
                    if not req.Test():
                        continue
                    note = notes[r].copy()
                    if note[2] != key or note[1] - margin <= time.time():  # another set's, or its sender gave up
                        gave_up[r] = note[1]
                        notes[r][:] = 0
                        recvs[r] = self.comm.Irecv(notes[r], source=r, tag=note_tag)
                    else:
                        got[r] = note
                        gave_up.pop(r, None)
                        del recvs[r]
                if not recvs:
                    break
                left = ends - time.time()
                if left <= 0:
                    break
                time.sleep(min(nap, left))
                nap = min(nap * 2, 0.05)
        finally:
            for req in recvs.values():
                req.Cancel()
                req.Wait()
            for req in sends:
                if not req.Test():
                    req.Free()  # (a small note is sent eagerly; a member that comes late takes it, and drops it)
        if recvs:
            missing = sorted(recvs)
            detail = "".join(f"; rank {r} came to it before but gave up (its timeout ended "
                             f"{max(0.0, came - gave_up[r]):.1f} s before this rank came)"
                             for r in missing if r in gave_up)
            raise MembersMissingError(
                f"{what} of ranks {ranks} on rank {self.rank}: rank{'s' if len(missing) > 1 else ''} "
                f"{', '.join(map(str, missing))} of its members did not come within the timeout of {timeout:g} s"
                f"{detail}; nothing was made", missing)
        last = max([came] + [note[0] for note in got.values()])
        first_end = min([ends] + [note[1] for note in got.values()])
        if last > first_end - margin:
            arrivals = {self.rank: came, **{r: note[0] for r, note in got.items()}}
            late = max(arrivals, key=arrivals.get)
            raise MembersMissingError(
                f"{what} of ranks {ranks} on rank {self.rank}: every member came, but rank {late} came too late for "
                f"the others (less than {margin:g} s before the earliest end of a member's timeout of {timeout:g} s); "
                "nothing was made", [late])

    def remove_members_only(self, process_set: ProcessSet, reason: Optional[str] = None) -> bool:
        """Stop the engine of a set of ``add_members_only`` and free its communicators; False when it is not one
        (or removed already). Not collective: the engine's shutdown is agreed by its members' engines, so the
        other members' engines stop too, and what they submit after it fails with ``reason``."""
        set_id = getattr(process_set, "process_set_id", None)
        with self._lock:
            if set_id is None or self.member_sets.get(set_id) is not process_set:
                return False
            del self.member_sets[set_id]
            engine = self.engines.pop(set_id, None)
            self._release(set_id)
        if engine is not None:
            engine.shutdown(reason=reason or f"the process set of ranks {process_set.ranks} was removed on rank "
                                             f"{self.rank}")
        try:
            process_set.mpi_comm.Free()
        except Exception:  # noqa: BLE001 - freed already (MPI finalized)
            pass
        return True

    def _id_of(self, ranks: List[int]) -> Optional[int]:
        """The id of the registered set of these ranks (0: the global set), or None."""
        for set_id, s in self.sets.items():
            if s.ranks == ranks:
                return set_id
        return None

    def ids_and_ranks(self) -> Dict[int, List[int]]:
        """Every registered set's ranks by id (Horovod's ``_basics._get_process_set_ids_and_ranks()``)."""
        return {set_id: list(s.ranks) for set_id, s in sorted(self.sets.items())}

    def id_of_comm(self, comm) -> int:
        """The id of the registered set whose processes are those of ``comm`` (an mpi4py communicator)."""
        set_id = self._id_of(self._comm_ranks(comm))
        if set_id is None:
            raise ValueError("MPI communicator does not correspond to any registered process set")
        return set_id

    def remove(self, process_set: ProcessSet) -> bool:
        """Shut the set's engine down (collective); False for the global set or one not registered."""
        set_id = self._registered_id(process_set)
        mine = set_id if isinstance(process_set, ProcessSet) else f"a {type(process_set).__name__}"
        with self._lock:
            everyone = self._everyone(mine, "remove_process_set")  # (collective also when the argument is wrong)
            if any(s != everyone[0] for s in everyone):
                raise ValueError(f"remove_process_set was called for different sets on different ranks ({everyone})")
            not_a_set(process_set)
            if not set_id or set_id not in self.sets:
                return False
            engine = self.engines.pop(set_id, None)
            del self.sets[set_id]
            self._free_ids.append(set_id)
            self._release(set_id)
        if engine is not None:
            engine.shutdown(reason=f"process set {set_id} (ranks {process_set.ranks}) was removed "
                                   "(remove_process_set)")
        process_set.process_set_id = None
        return True

    def _release(self, set_id: int) -> None:
        """Every object of set ``set_id`` lets its id go (the set was removed, or the table shut down)."""
        for holder in self._holders.pop(set_id, []):
            if holder.process_set_id == set_id:
                holder.process_set_id = None

    def _registered_id(self, process_set) -> Optional[int]:
        """The id of ``process_set`` when it names a registered set: the id's set has its ranks (an object that
        kept the id of a set since removed does not name the set that has the id now); else None."""
        set_id = getattr(process_set, "process_set_id", None)
        if isinstance(process_set, ProcessSet) and set_id is not None and set_id < 0:  # (a set of its members only)
            return set_id if self.member_sets.get(set_id) is process_set else None
        if not isinstance(process_set, ProcessSet) or set_id not in self.sets:
            return None
        if set_id and self.sets[set_id] is not process_set and self.sets[set_id].ranks != process_set.ranks:
            return None
        return set_id

    def _ranks_of(self, process_set: ProcessSet) -> List[int]:
        return list(process_set.ranks) if process_set.ranks is not None else self._comm_ranks(process_set.mpi_comm)

    def _comm_ranks(self, comm) -> List[int]:
        """The job's ranks of ``comm``'s processes, sorted; ValueError for a null communicator or one with
        processes outside the job."""
        from .transport.mpi import import_mpi  # noqa: PLC0415

        MPI = import_mpi()
        if comm == MPI.COMM_NULL:
            raise ValueError("ProcessSet(MPI.COMM_NULL): a process set's communicator must hold this rank")
        group, job = comm.Get_group(), self.comm.Get_group()
        try:
            ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), job)
        finally:
            group.Free()
            job.Free()
        if any(r == MPI.UNDEFINED for r in ranks):
            raise ValueError(f"ProcessSet({comm}): the communicator holds processes that are not ranks of this job")
        return sorted(ranks)

    def _config_for(self, set_id: int):
        timeline, mark_cycles = self.timeline
        if timeline and timeline != DYNAMIC_TIMELINE:
            timeline = f"{timeline}.set{set_id}"
        return dataclasses.replace(self.config, timeline=timeline, timeline_mark_cycles=mark_cycles, autotune=False)

    # ---- lookup -----------------------------------------------------------------------------
    def engine_for(self, process_set, what: str):
        """The engine running ``process_set`` on this rank; an error naming the set and the rank when
        the set is not registered or this rank is not in it."""
        if process_set is None or process_set is global_process_set:
            return self.engines[0]
        set_id = self.check_registered(process_set, what)
        engine = self.engines.get(set_id)
        if engine is None:
            raise ValueError(f"{what}: rank {self.rank} is not in process set {set_id} (ranks {process_set.ranks})")
        return engine

    def check_registered(self, process_set, what: str) -> int:
        """The id of ``process_set``; ValueError naming ``what`` and the set when it is not registered."""
        set_id = self._registered_id(process_set)
        if set_id is None:
            raise ValueError(f"{what}: {process_set!r} is not a registered process set; add it with "
                             "add_process_set (or init(process_sets=...)) first")
        return set_id

    def root_in(self, process_set, root: int, what: str) -> int:
        """``root`` (a rank of the job) as a rank of the set's engine."""
        if process_set is None or process_set is global_process_set:
            return root
        if root not in process_set.ranks:
            raise InvalidArgumentError(f"{what}: root_rank={root} is not in process set {process_set.process_set_id} "
                             f"(ranks {process_set.ranks})")
        return process_set.ranks.index(root)

    def shutdown(self) -> None:
        """Stop every set's engine (not the global one) and free the control communicator."""
        global _current
        for set_id in sorted(self.engines, reverse=True):
            if set_id:
                try:
                    self.engines.pop(set_id).shutdown()
                except AiaccError:  # pragma: no cover - already stopped
                    pass
        for process_set in self.member_sets.values():
            try:
                process_set.mpi_comm.Free()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        self.member_sets.clear()
        for set_id in list(self._holders):  # (sets this rank is not in too: their objects hold ids as well)
            self._release(set_id)
        try:
            self.comm.Free()
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass
        if _current is self:
            _current = None


class HorovodBasics:
    """The two calls Horovod's own tests make on its core (``hvd.mpi_ops._basics``), for the adapters'
    ``mpi_ops`` modules: the registered sets' ranks by id, and the id of a communicator's set."""

    @staticmethod
    def _get_process_set_ids_and_ranks() -> Dict[int, List[int]]:
        if _current is None:  # switched off (or not initialized): the job of one rank
            return {0: list(global_process_set.ranks or [0])}
        return _current.ids_and_ranks()

    @staticmethod
    def _comm_process_set_id(comm) -> int:
        if _current is None:
            raise ValueError("aiacc is not initialized with process sets; call init() first")
        return _current.id_of_comm(comm)
