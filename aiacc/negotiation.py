"""Agreement across ranks on which tensors every rank has submitted.

Every cycle each rank contributes one small uint8 vector to a bitwise-AND
allreduce::

    byte 0      flags, inverted so that AND means "no rank wants it":
                  bit 0  1 = I have nothing new to announce
                  bit 1  1 = I do not ask for shutdown
                  bit 2  1 = I do not ask for a stall check
                  bit 3  1 = I can take more allreduces in flight (pipelined mode)
    bytes 1..   one bit per response-cache entry: 1 = I have that tensor
                pending with the cached signature (a joined rank sets all)

A cached tensor whose bit survives the AND is ready on every rank: after the
first step, agreement costs this one collective for all tensors together.

When some rank has an uncached tensor (bit 0 cleared), all ranks take the
slow path in the same cycle: they allgather the (name, signature, priority)
of their new tensors and add them to a table that is identical on every
rank. A name whose table row holds every (non-joined) rank is ready: its
signatures are compared and it becomes either a response or, on every rank
alike, an error naming the tensor and the ranks. Good responses enter the
cache. Since every rank processes the same gathered data in the same order,
cache slots, readiness and errors are the same everywhere without a
coordinator.

An announcement of a name that is in the cache evicts it everywhere; ranks
holding that name under the old signature re-announce it next cycle, so a
changed shape on one rank becomes a mismatch error, never a hang.
"""

from __future__ import annotations

import collections
import operator
from typing import Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from .compression import as_compressor
from .ops import Collective, ReduceOp
from .tensors import dtype_from_name

__all__ = ["Meta", "Response", "Cycle", "CacheEntry", "FuseKey", "StallEntry", "ResponseCache", "Negotiator",
           "JOIN_NAME", "describe_mismatch"]

NO_ANNOUNCE = 1
NO_SHUTDOWN = 2
NO_STALL_CHECK = 4
MAY_SEND = 8
FEW_BITS = 64  # up to this many agreed bits a cycle reads them without numpy (Negotiator._ready_bits)

JOIN_NAME = "__aiacc_join__"
_UNCACHED_KINDS = (Collective.BARRIER, Collective.JOIN)
_ADASUM = int(ReduceOp.ADASUM)  # its allreduces are never cached: each one is negotiated and run alone


class Meta(NamedTuple):
    """What must be equal on every rank for a tensor name (its signature)."""

    kind: int
    op: int
    root: int
    prescale: float
    postscale: float
    compression: str
    # one (dtype string, shape) per tensor of the request; for allgather and
    # alltoall the first dimension may differ per rank and is stored as -1.
    entries: Tuple[Tuple[str, Tuple[int, ...]], ...]
    device: str = "cpu"  # "cpu" (MPI) or "cuda" (NCCL)
    # names of the tensors one buffer already fuses (a gradient bucket): reduced where it lies
    labels: Tuple[str, ...] = ()


class Response:
    """A tensor agreed on by every rank, identical everywhere (but ``request``)."""

    __slots__ = ("name", "meta", "priority", "request", "error", "joined", "last_joined")

    def __init__(self, name: str, meta: Meta, priority: float, request=None, error: Optional[str] = None,
                 joined: frozenset = frozenset()):
        self.name = name
        self.meta = meta
        self.priority = priority
        self.request = request  # this rank's request (None on a rank that joined)
        self.error = error
        self.joined = joined
        self.last_joined = -1  # for JOIN: the rank that joined last


class Cycle(NamedTuple):
    """What one agreement decided, the same on every rank (but the requests).

    Tensors agreed through the cache come as ``entries`` (their cache entries, in bit order) and
    ``cached`` (this rank's requests behind them; None where this rank joined); those agreed on
    the slow path as ``responses`` (errors included).
    """

    entries: list
    cached: list
    responses: list
    joined: frozenset
    shutdown: bool
    stall_check: bool
    may_send: bool


class FuseKey(NamedTuple):
    """What tensors must share to travel in one fusion buffer."""

    wire: np.dtype
    op: int
    device: str
    postscale: float


class StallEntry(NamedTuple):
    """A tensor some rank waits for: who has submitted it, who has not, since when."""

    name: str
    have: List[int]
    missing: List[int]
    age: float  # seconds since the oldest submission


class CacheEntry:
    """An agreed signature in the response cache, with what bucketing needs to know of it,
    worked out once: ``whole`` (an allreduce of one tensor, or of a group of one dtype, sent as it
    is: no prescale, no cast),
    ``fuse_key`` (what it may share a fusion buffer with; None for a buffer that is already a
    fusion of tensors, sent on its own), ``count`` and ``nbytes`` on the wire."""

    __slots__ = ("name", "meta", "priority", "bit", "whole", "fuse_key", "count", "nbytes")

    def __init__(self, name, meta, priority, bit):
        self.name, self.meta, self.priority, self.bit = name, meta, priority, bit
        self.whole = False
        self.fuse_key = None
        self.count = self.nbytes = 0
        dtypes = {dtype_text for dtype_text, _ in meta.entries}
        if meta.kind == Collective.ALLREDUCE and len(dtypes) == 1 and meta.prescale == 1.0:
            # one tensor, or a group of tensors of one dtype (a grouped allreduce travels whole)
            dtype = dtype_from_name(dtypes.pop())
            wire = as_compressor(meta.compression).wire_dtype(dtype)
            if wire == dtype:
                self.whole = True
                self.count = sum(int(np.prod(shape, dtype=np.int64)) for _, shape in meta.entries)
                self.nbytes = self.count * wire.itemsize
                if not meta.labels:
                    self.fuse_key = FuseKey(wire, meta.op, meta.device, meta.postscale)


class ResponseCache:
    """Agreed signatures by name, each holding one bit position; least recently used out first
    (``last_used``: the cycle each bit was last agreed in, set for a cycle's bits at once). ``high``: one past the
    highest bit ever given (bits are given lowest first, freed ones again first): the same on every rank, so a
    cycle's bit vector covers those bits only, as Horovod's ``num_active_bits`` (each cycle packed and reduced the
    whole capacity: 0.93 ms of CPU a cycle at 1048576 for a job with one name, 0.12 ms now)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.high = 0
        self.by_name: Dict[str, CacheEntry] = {}
        self.by_bit: List[Optional[CacheEntry]] = [None] * capacity
        self.last_used = np.zeros(capacity, dtype=np.int64)
        self._free: List[int] = []  # freed bits below ``high``

    def put(self, name: str, meta: Meta, priority: float, cycle: int, evict) -> Optional[CacheEntry]:
        if self.capacity == 0:
            return None
        if not self._free and self.high == self.capacity:
            # full: every bit holds an entry. The least recently used goes, the lowest bit among equals (the same
            # on every rank), unless it was agreed in this very cycle: one argmin (a Python scan of every entry
            # cost ~200 us per new name at the default capacity)
            bit = int(np.argmin(self.last_used))
            if self.last_used[bit] >= cycle:
                return None
            evict(self.by_bit[bit].name)
        if self._free:
            bit = self._free.pop()
        else:
            bit, self.high = self.high, self.high + 1
        entry = self.by_name[name] = self.by_bit[bit] = CacheEntry(name, meta, priority, bit)
        self.last_used[bit] = cycle
        return entry

    def remove(self, name: str) -> Optional[CacheEntry]:
        entry = self.by_name.pop(name, None)
        if entry is not None:
            self.by_bit[entry.bit] = None
            self._free.append(entry.bit)
        return entry


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(str(r) for r in ranks)


def _shape_text(shape) -> str:
    if shape is None:  # (a shape some rank did not know: see buckets.check_same_gradients)
        return "unknown"
    return "(" + ", ".join("*" if s < 0 else str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _in_job(meta: Meta, job_ranks: List[int]) -> Meta:
    """``meta`` with its root as a rank of the job (a process set's engine agrees on the root's position in
    the set; messages name the rank the caller passed)."""
    return meta._replace(root=job_ranks[meta.root]) if 0 <= meta.root < len(job_ranks) else meta


def describe_mismatch(name: str, metas: Dict[int, Meta]) -> Optional[str]:
    """None if all ranks agree on ``name``; else a message naming the field and the ranks."""
    first = next(iter(metas.values()))
    if all(m == first for m in metas.values()):
        return None

    def split(key) -> Optional[str]:
        groups: Dict[object, List[int]] = {}
        for r, m in metas.items():
            groups.setdefault(key(m), []).append(r)
        if len(groups) == 1:
            return None
        return "; ".join(f"{_ranks(rs)}: {val}" for val, rs in sorted(groups.items(), key=lambda kv: min(kv[1])))

    checks = [
        ("operation", lambda m: str(Collective(m.kind))),
        ("number of tensors", lambda m: len(m.entries)),
    ]
    for what, key in checks:
        detail = split(key)
        if detail:
            return f"tensor {name!r}: {what} differs across ranks ({detail})"
    n = len(first.entries)
    for i in range(n):
        label = f"tensor {name!r}" if n == 1 else f"tensor {name!r} (entry {i} of the group)"
        for what, key in (("dtype", lambda m: m.entries[i][0]), ("shape", lambda m: _shape_text(m.entries[i][1]))):
            detail = split(key)
            if detail:
                return f"{label}: {what} differs across ranks ({detail})"
    for what, key in (
        ("reduce op", lambda m: str(ReduceOp(m.op))),
        ("root rank", lambda m: m.root),
        ("prescale factor", lambda m: m.prescale),
        ("postscale factor", lambda m: m.postscale),
        ("compression", lambda m: m.compression),
        ("device", lambda m: m.device),
        ("fused tensors", lambda m: ", ".join(m.labels) or "none"),
    ):
        detail = split(key)
        if detail:
            return f"tensor {name!r}: {what} differs across ranks ({detail})"
    return f"tensor {name!r}: signature differs across ranks"  # pragma: no cover - all fields covered above


def _joined_error(name: str, meta: Meta, joined: frozenset) -> Optional[str]:
    """While some ranks have joined, only allreduces run (the joined ranks contribute the op's
    identity); anything else is an error on every rank, cached or not (as in Horovod)."""
    if joined and (meta.kind != Collective.ALLREDUCE or meta.op == _ADASUM):
        adasum = meta.kind == Collective.ALLREDUCE
        return (f"tensor {name!r}: {'an Adasum allreduce' if adasum else Collective(meta.kind)} cannot run while "
                f"{_ranks(joined)} {'has' if len(joined) == 1 else 'have'} called join(); only allreduce can"
                + (" (with the other ops)" if adasum else ""))
    return None


class Negotiator:
    """This rank's side of the agreement. Called only from the engine thread.

    Requests wait in one of three places until agreed: ``_by_bit`` (a cached name with the cached
    signature: one bit each), ``_to_announce`` (new to the cache: announced in the next slow path)
    or ``pending`` (announced, waiting for other ranks).
    """

    def __init__(self, rank: int, size: int, transport, cache_capacity: int):
        self.rank = rank
        self.size = size
        self.transport = transport
        self.cache = ResponseCache(cache_capacity)
        self.cycle_no = 0
        self.pending: Dict[str, object] = {}  # name -> request, announced and not yet agreed
        self._bits = np.zeros(cache_capacity, dtype=bool)
        self._by_bit: Dict[int, object] = {}
        self._to_announce: List[object] = []
        # name -> {rank: (meta, priority)}; identical on every rank
        self.table: Dict[str, Dict[int, Tuple[Meta, float]]] = {}
        self.slow_cycles = 0
        self._vec = np.empty(1 + (cache_capacity + 7) // 8, dtype=np.uint8)
        # a process set's engine: its ranks in the job (errors and stall reports name those), else None
        self.job_ranks: Optional[List[int]] = None

    # ---- local side -------------------------------------------------------------
    def add(self, req) -> None:
        self.add_all(collections.deque((req,)))

    def add_all(self, queue) -> None:
        """Take every request of ``queue`` (a deque, emptied; submits may append meanwhile): a cached name
        with the cached signature sets its bit, anything else is announced. A training step's hundreds of
        submits in one loop, its lookups hoisted."""
        find = self.cache.by_name.get
        bits, by_bit, announce, popleft = self._bits, self._by_bit, self._to_announce.append, queue.popleft
        while queue:
            req = popleft()
            entry = find(req.name)
            if entry is not None:
                meta = req.meta
                if entry.meta is not meta:
                    if entry.meta != meta:
                        announce(req)
                        continue
                    # (the cached signature came through the gather; the request's own object, equal to
                    # it, makes the next step's comparison an identity check)
                    entry.meta = meta
                bit = entry.bit
                bits[bit] = True
                by_bit[bit] = req
            else:
                announce(req)

    def waiting(self) -> List[object]:
        """Every local request not agreed yet."""
        return list(self._by_bit.values()) + self._to_announce + list(self.pending.values())

    def has_waiting(self) -> bool:
        return bool(self._by_bit or self._to_announce or self.pending)

    def _evict(self, name: str) -> None:
        entry = self.cache.remove(name)
        if entry is None:
            return
        self._bits[entry.bit] = False
        req = self._by_bit.pop(entry.bit, None)
        if req is not None:
            self._to_announce.append(req)

    def joined_ranks(self) -> frozenset:
        row = self.table.get(JOIN_NAME)
        return frozenset(row) if row else frozenset()

    # ---- one cycle ----------------------------------------------------------------
    def cycle(self, want_shutdown: bool, want_stall_check: bool, may_send: bool = True) -> Cycle:
        """Run one agreement (a collective)."""
        self.cycle_no += 1
        flags = MAY_SEND if may_send else 0
        if not self._to_announce:
            flags |= NO_ANNOUNCE
        if not want_shutdown:
            flags |= NO_SHUTDOWN
        if not want_stall_check:
            flags |= NO_STALL_CHECK
        joined = self.joined_ranks()
        high = self.cache.high  # (the bits in use: the same on every rank)
        nbytes = (high + 7) >> 3
        vec = self._vec[:1 + nbytes]
        vec[0] = flags
        if nbytes:
            vec[1:] = 0xFF if self.rank in joined else np.packbits(self._bits[:high])
        result = self.transport.bitwise_and(vec)

        entries: list = []
        cached: list = []
        if nbytes and result[1:].any():
            ready = self._ready_bits(result[1:])
            by_bit = self.cache.by_bit
            if joined:  # a joined rank sets every bit, free slots included, and holds no request behind some
                ready = [bit for bit in ready if by_bit[bit] is not None]
                pop = self._by_bit.pop
                cached = [pop(bit, None) for bit in ready]
            else:  # every agreed bit is one this rank set
                cached = list(map(self._by_bit.pop, ready))
            bits, last_used, cycle_no = self._bits, self.cache.last_used, self.cycle_no
            if len(ready) <= FEW_BITS:
                for bit in ready:
                    bits[bit] = False
                    last_used[bit] = cycle_no
            else:
                where = np.asarray(ready, dtype=np.intp)
                bits[where] = False
                last_used[where] = cycle_no
            entries = list(operator.itemgetter(*ready)(by_bit)) if len(ready) > 1 else [by_bit[b] for b in ready]
        flags = int(result[0])
        responses = self._slow_path() if not flags & NO_ANNOUNCE else []
        return Cycle(entries, cached, responses, joined, not flags & NO_SHUTDOWN, not flags & NO_STALL_CHECK,
                     bool(flags & MAY_SEND))

    def _ready_bits(self, packed: np.ndarray) -> List[int]:
        """The cache bits set in ``packed`` (``np.packbits`` of the bit vector), in ascending order. Few
        bits (a synchronous call, a step's handful of buckets) are read off a Python int: 1.6 us a cycle
        where ``unpackbits`` + ``flatnonzero`` took 7.4 (measured, 1024 bits); many go through numpy."""
        capacity = self.cache.high
        value = int.from_bytes(packed.tobytes(), "big")  # bit i of the vector is bit (total - 1 - i)
        if value.bit_count() > FEW_BITS:
            return np.flatnonzero(np.unpackbits(packed, count=capacity)).tolist()
        total = packed.size * 8
        ready = []
        while value:
            low = value & -value
            bit = total - low.bit_length()
            if bit < capacity:  # (a joined rank's 0xFF sets the padding bits too)
                ready.append(bit)
            value ^= low
        ready.reverse()
        return ready

    @staticmethod
    def responses_of(cycle: Cycle) -> List[Response]:
        """Every tensor agreed in ``cycle`` as a Response: the cached ones (bit order), then the rest."""
        joined = cycle.joined
        return [Response(e.name, e.meta, e.priority, req, _joined_error(e.name, e.meta, joined), joined)
                for e, req in zip(cycle.entries, cycle.cached)] + cycle.responses

    def _slow_path(self) -> List[Response]:
        self.slow_cycles += 1
        for req in self._to_announce:
            self.pending[req.name] = req
        mine = [(r.name, r.meta, r.priority) for r in self._to_announce]
        self._to_announce = []
        gathered = self.transport.allgather_object(mine)
        for r, announcements in enumerate(gathered):
            for name, meta, priority in announcements:
                if name in self.cache.by_name:
                    self._evict(name)
                self.table.setdefault(name, {})[r] = (meta, priority)

        joined = self.joined_ranks()
        everyone = set(range(self.size))
        responses: List[Response] = []
        for name in list(self.table):
            row = self.table[name]
            if name == JOIN_NAME:
                if len(row) < self.size:
                    continue
            elif not everyone <= (row.keys() | joined):
                continue
            del self.table[name]
            metas = {r: m for r, (m, _) in row.items()}
            lowest = min(row)
            meta, priority = row[lowest]
            error = describe_mismatch(name, metas if self.job_ranks is None else
                                      {self.job_ranks[r]: _in_job(m, self.job_ranks) for r, m in metas.items()})
            if error is not None and self.job_ranks is not None:
                error += f" in the process set of ranks {self.job_ranks}"
            if error is None and name != JOIN_NAME:
                error = _joined_error(name, meta, joined)
            req = self.pending.pop(name, None)
            resp = Response(name, meta, priority, req, error, joined if name != JOIN_NAME else frozenset())
            if name == JOIN_NAME:
                resp.last_joined = list(row)[-1]
            elif error is None and meta.kind not in _UNCACHED_KINDS and meta.op != _ADASUM:  # (Adasum: never fused)
                self.cache.put(name, meta, priority, self.cycle_no, self._evict)
            responses.append(resp)
        return responses

    # ---- stalls -------------------------------------------------------------------
    def stall_report(self, now: float) -> List[StallEntry]:
        """Collective: every tensor some rank waits for and another has not submitted, oldest first."""
        ages = {req.name: now - req.t_submit for req in self.waiting()}
        gathered = self.transport.allgather_object(ages)
        joined = self.joined_ranks()
        names: Dict[str, Tuple[List[int], float]] = {}
        for r, theirs in enumerate(gathered):
            for name, age in theirs.items():
                have, oldest = names.get(name, ([], 0.0))
                have.append(r)
                names[name] = (have, max(oldest, age))
        report = []
        for name, (have, age) in names.items():
            missing = sorted(set(range(self.size)) - set(have) - joined)
            if missing:
                if self.job_ranks is not None:  # (a process set's engine: the ranks in the job)
                    have, missing = [self.job_ranks[r] for r in have], [self.job_ranks[r] for r in missing]
                report.append(StallEntry(name, sorted(have), missing, age))
        report.sort(key=lambda item: -item.age)
        return report

    def take_all(self) -> List[object]:
        """Remove and return every local request not yet agreed (at shutdown)."""
        reqs = self.waiting()
        self.pending.clear()
        self._by_bit.clear()
        self._bits[:] = False
        self._to_announce = []
        return reqs
