"""Process sets: collectives among a subset of the ranks (Horovod's API).

A process set this rank belongs to runs on an engine of its own: an MPI
communicator of its members (split from the job's), its own negotiation and
response cache, its own thread. So the sets never wait for each other, and a
rank takes part only in the sets it is in. The global set is the job's
engine. Adding and removing a set is collective over every rank of the job,
as in Horovod (where it needs ``HOROVOD_DYNAMIC_PROCESS_SETS=1``; here it
always works); sets passed to ``init(process_sets=...)`` are added there.

Ranks are always the job's ranks: ``broadcast(..., root_rank, process_set=s)``
takes the root's global rank, as Horovod's does; results of allgather and
reducescatter follow the order of the set's ranks.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Dict, List, Optional

from .exceptions import AiaccError, InvalidArgumentError

__all__ = ["ProcessSet", "ProcessSetTable", "global_process_set"]


class ProcessSet:
    """A set of ranks that run collectives together: ``ProcessSet([0, 2])`` (ranks of the job). Pass it
    to ``init(process_sets=[...])`` or ``add_process_set``; ``process_set_id`` is set once it is
    registered. (Horovod also accepts an mpi4py communicator; aiacc refuses to register one, with a
    clear error: pass its ranks.)"""

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
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(f"ProcessSet ranks must be whole numbers, got {ranks!r}")
        self.ranks = ranks

    def size(self) -> Optional[int]:
        """The number of ranks in the set (None until registered)."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> Optional[int]:
        """This rank's position in the set (None until registered, or when this rank is not in it)."""
        if self.process_set_id is None or not self.included():
            return None
        return self.ranks.index(_table_rank())

    def included(self) -> Optional[bool]:
        """Whether this rank belongs to the set (None before the ranks are known)."""
        if self.ranks is None:
            return None
        return _table_rank() in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

_current: Optional["ProcessSetTable"] = None


def _table_rank() -> int:
    return _current.rank if _current is not None else 0


class ProcessSetTable:
    """The registered sets of this process and their engines (one table per ``init``)."""

    def __init__(self, comm, config, global_engine, rank: int, size: int, make_engine):
        global _current
        self.comm = comm  # a private duplicate of the job's communicator, for adding and removing sets
        self.config = config
        self.rank, self.size = rank, size
        self._make_engine = make_engine
        self._lock = threading.Lock()
        self._next_id = 1
        self.sets: Dict[int, ProcessSet] = {0: global_process_set}
        self.engines: Dict[int, object] = {0: global_engine}
        global_process_set.ranks = list(range(size))
        _current = self

    # ---- registration (collective over every rank of the job) ------------------------------
    def add(self, process_set) -> ProcessSet:
        if not isinstance(process_set, ProcessSet):
            process_set = ProcessSet(process_set)
        if process_set.process_set_id is not None:
            raise ValueError(f"{process_set} is registered already")
        ranks = self._ranks_of(process_set)
        with self._lock:
            everyone = self.comm.allgather(tuple(ranks))
            if any(r != everyone[0] for r in everyone):
                detail = "; ".join(f"rank {k}: {list(r)}" for k, r in enumerate(everyone))
                raise ValueError(f"add_process_set was called with different ranks on different ranks ({detail}); "
                                 "every rank must add the same sets in the same order")
            if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < self.size for r in ranks):
                raise ValueError(f"a process set needs distinct ranks in 0..{self.size - 1}, got {ranks}")
            if any(s.ranks == ranks for s in self.sets.values()):
                raise ValueError(f"Attempted to add a duplicate process set: ranks {ranks} form a set already")
            from .transport.mpi import import_mpi  # noqa: PLC0415

            MPI = import_mpi()
            sub = self.comm.Split(0 if self.rank in ranks else MPI.UNDEFINED, key=self.rank)
            set_id = self._next_id
            self._next_id += 1
            if sub != MPI.COMM_NULL:
                try:
                    self.engines[set_id] = self._make_engine(self._config_for(set_id), sub)
                finally:
                    sub.Free()
            process_set.ranks = ranks
            process_set.process_set_id = set_id
            self.sets[set_id] = process_set
        return process_set

    def remove(self, process_set: ProcessSet) -> bool:
        """Shut the set's engine down (collective); False for the global set or one not registered."""
        set_id = getattr(process_set, "process_set_id", None)
        with self._lock:
            everyone = self.comm.allgather(set_id)
            if any(s != everyone[0] for s in everyone):
                raise ValueError(f"remove_process_set was called for different sets on different ranks ({everyone})")
            if not set_id or set_id not in self.sets:
                return False
            engine = self.engines.pop(set_id, None)
            del self.sets[set_id]
        if engine is not None:
            engine.shutdown()
        process_set.process_set_id = None
        return True

    @staticmethod
    def _ranks_of(process_set: ProcessSet) -> List[int]:
        if process_set.ranks is None:
            raise NotImplementedError("a ProcessSet made from an MPI communicator cannot be registered by aiacc; "
                                      "pass the list of its ranks (ranks of the job) instead")
        return list(process_set.ranks)

    def _config_for(self, set_id: int):
        timeline = f"{self.config.timeline}.set{set_id}" if self.config.timeline else ""
        return dataclasses.replace(self.config, timeline=timeline, autotune=False)

    # ---- lookup -----------------------------------------------------------------------------
    def engine_for(self, process_set, what: str):
        """The engine running ``process_set`` on this rank; an error naming the set and the rank when
        the set is not registered or this rank is not in it."""
        if process_set is None or process_set is global_process_set:
            return self.engines[0]
        set_id = getattr(process_set, "process_set_id", None)
        if not isinstance(process_set, ProcessSet) or set_id not in self.sets:
            raise ValueError(f"{what}: {process_set!r} is not a registered process set; add it with "
                             "add_process_set (or init(process_sets=...)) first")
        engine = self.engines.get(set_id)
        if engine is None:
            raise ValueError(f"{what}: rank {self.rank} is not in process set {set_id} (ranks {process_set.ranks})")
        return engine

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
                self.sets[set_id].process_set_id = None
        try:
            self.comm.Free()
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass
        if _current is self:
            _current = None
