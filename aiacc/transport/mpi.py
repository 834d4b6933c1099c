"""MPI transport through mpi4py: the collectives the engine runs on host buffers.

Only the engine's background thread calls into this module once the engine
runs, on a communicator of its own (a ``Dup`` of the user's), so aiacc's
traffic never mixes with MPI calls the user makes.

Waiting: MPICH's blocking calls spin on the CPU. The negotiation collective is
where a rank's engine waits for slower ranks (one rank still computing), so it
is posted non-blocking and waited on politely: a short spin, then sleeps that
grow to a millisecond. On a machine with fewer cores than threads this keeps
the waiting engine from taking CPU away from the training thread. Data
collectives start right after negotiation, but a rank's engine thread can be
late (waiting for the GIL or for a core), so allreduces up to SPIN_WAIT_BYTES
spin only for about their transfer time before they wait politely too.

Larger allreduces depend on the link. Over shared memory the CPU does the
copying and must poll MPI's progress, so they wait in MPI's Wait. Over a network a blocking
call spins a core for the whole transfer (measured on a 1 Gbit/s link: an
8 MiB allreduce took 134 ms and 134 ms of CPU blocking, 134 ms and 17 ms of
CPU polled every 200 us), a core the training thread needs. So the transport
keeps the peak bandwidth it achieves and, below NETWORK_BYTES_PER_S,
polls large allreduces with naps of about 1/50 of their expected time.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import itertools
import os
import sys
import threading
import time
from typing import Callable, List, Optional, Sequence

import numpy as np

from ..compression import bfloat16_dtype, cast_into
from ..ops import ReduceOp, scatter_rows

__all__ = ["MPITransport", "import_mpi"]

# Allreduces up to this size are posted non-blocking and waited on with a short spin, then
# politely; larger ones wait in MPI's Wait, whose progress needs the polling (measured here: an 8 MiB
# allreduce took 40% longer when waited on politely, while at 256 KiB a polite wait for a peer
# 5 ms late cost a third of the CPU of a blocking one at the same latency).
SPIN_WAIT_BYTES = 4 << 20
# Achieved allreduce bandwidth below which the link is a slow network, not memory: shared memory on
# a busy 2-core machine still reaches 0.5-3 GB/s (and needs polling to progress), a 1 Gbit/s link 0.06.
NETWORK_BYTES_PER_S = 2.5e8
# While a thread of this rank waits on a handle, a wait polls (yielding the core) this long first.
HURRY_SPIN_SECONDS = 2e-3
# How long a small allreduce spins for its peers before waiting politely while no thread waits for it.
SPIN_UNHURRIED_SECONDS = 30e-6
# Sums of 16-bit floats run in chunks of this many elements (2 MiB), this many chunks at a time. Tried on
# the emulated 2 x 2 hosts at 2.5 Gbit/s: 4 M-element chunks, 2 at a time, reduced 96 MB of float32 in
# 254-257 ms against 295-315 (alternating in one job), but BERT's scaling efficiency with Compression.fp16 /
# .bf16 read 0.844 / 0.842 with them against 0.829-0.855 / 0.855-0.856 with these: no gain in training.
SUM16_CHUNK_ELEMENTS = 1 << 20
SUM16_WINDOW = 3
ABORT_GRACE_SECONDS = 0.3  # between writing why and MPI_Abort (see MPITransport.abort)


def import_mpi(start_timeout: float = 0.0, variable: str = "AIACC_START_TIMEOUT"):
    """Import mpi4py.MPI (which starts MPI) asking for MPI_THREAD_MULTIPLE.

    A script that set ``mpi4py.rc.initialize = False`` (Horovod's own tests do) has MPI imported but
    not started: aiacc then starts it, as Horovod's core does, and finalizes it when the process exits
    (after aiacc's own shutdown, which ``init`` registers later, so runs first). With ``start_timeout``
    (``AIACC_START_TIMEOUT``) aiacc starts MPI itself that way too, waiting at most that long for the other
    ranks (``_start``); ``variable``: what set it (Horovod's ``HOROVOD_START_TIMEOUT``), named in its error."""
    import mpi4py  # noqa: PLC0415 - MPI must not start at aiacc import time

    if "mpi4py.MPI" not in sys.modules:
        _without_ucx_mmap_hooks()  # (read when the MPI library loads)
        mpi4py.rc.thread_level = "multiple"
        if start_timeout > 0:
            mpi4py.rc.initialize = False
    from mpi4py import MPI  # noqa: PLC0415

    if not MPI.Is_initialized():
        if MPI.Is_finalized():
            raise RuntimeError("MPI was finalized in this process already (MPI.Finalize() was called), and MPI "
                               "cannot start twice: aiacc needs it running; call aiacc's init before finalizing MPI")
        _start(MPI, start_timeout, variable)
        atexit.register(_finalize_mpi, MPI, os.getpid())
    return MPI


def _without_ucx_mmap_hooks(environ=os.environ) -> bool:
    """Before the MPI library loads: UCX's mmap hooks off, unless the user set them (UCX reads the variable
    when the library loads, so not after a script imported mpi4py.MPI itself).

    The ``mpich`` wheel's UCX netmod hooks mmap/munmap/brk (``UCX_MEM_MMAP_HOOK_MODE=bistro``, for its
    registration cache on InfiniBand). With those hooks installed, TensorFlow and MXNet keep memory for good
    as they run: every Python function TensorFlow runs from a graph (a ``tf.numpy_function``, the way aiacc's
    collectives are reached inside ``tf.function``) ~150 B, measured with one such op per step and MPI merely
    started (no aiacc), 152 B per step over 8000 steps; a TF training step through ``DistributedGradientTape``
    ~270-280 B, an MXNet ``DistributedTrainer`` step ~155 B (0.15-0.3 GB per million steps). All flat with
    ``UCX_MEM_MMAP_HOOK_MODE=none`` (TF also with ``UCX_MEM_EVENTS=no`` or ``MPIR_CVAR_CH4_NETMOD=ofi``);
    torch steps are flat either way. Set for every framework, since one may be imported after ``init()``.
    Shared memory and TCP need no registration cache; a user on InfiniBand who wants it sets the variable
    (``bistro``, UCX's default) and gets UCX's behaviour back. Returns whether it was set here."""
    if "UCX_MEM_MMAP_HOOK_MODE" in environ:
        return False
    environ["UCX_MEM_MMAP_HOOK_MODE"] = "none"
    return True


def _sum_blocks16(blocks: np.ndarray, out: np.ndarray, factor: float = 1.0) -> None:
    """``out`` = the sum of the rows of ``blocks`` (16-bit floats, one row per rank), added in float32 in rank order,
    times ``factor`` (Average's 1/n and the postscale, in float32) and rounded once: an average whose sum is beyond
    16 bits stays finite (40000 on 2 ranks is 40000, not inf), as DDP's divide-first gives; in chunks of
    SUM16_CHUNK_ELEMENTS (float32 arrays of a whole share made a 2 GiB float16 reducescatter peak at 4.5 x its size
    per rank; an allreduce's shares are chunks already)."""
    p, c = blocks.shape
    step = max(1, min(c, SUM16_CHUNK_ELEMENTS))
    acc = np.empty(step, np.float32)
    part = np.empty(step, np.float32)
    for lo in range(0, c, step):
        hi = min(c, lo + step)
        a, b = acc[:hi - lo], part[:hi - lo]
        cast_into(a, blocks[0, lo:hi])
        for i in range(1, p):
            cast_into(b, blocks[i, lo:hi])
            a += b
        if factor != 1.0:
            a *= np.float32(factor)
        cast_into(out[lo:hi], a)


_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "RANK")  # this rank, before MPI says so


def _start(MPI, timeout: float, variable: str = "AIACC_START_TIMEOUT") -> None:  # noqa: N803 - the module
    """``MPI_Init_thread``, waiting at most ``timeout`` seconds (0: forever) for every rank of the job to start.

    MPICH's launcher does not notice a rank that exits before it starts MPI (a script that fails before
    ``aiacc.init()``): the others waited in MPI's start-up forever. MPI is started through ctypes, which lets go
    of the GIL while it waits (mpi4py's ``Init_thread`` keeps it), so that a watchdog thread can end this rank
    with an error saying why; its exit makes the launcher end the job."""
    try:
        init = ctypes.CDLL(MPI.__file__).MPI_Init_thread  # (the MPI library mpi4py is linked to)
    except (OSError, AttributeError):
        init = None
    if timeout <= 0 or init is None:
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
        return
    started = threading.Event()

    def watch() -> None:
        if not started.wait(timeout):
            rank = next((os.environ[v] for v in _RANK_VARS if os.environ.get(v)), "?")
            sys.stderr.write(f"aiacc: rank {rank} has waited {timeout:g} s in MPI's start-up for the other ranks of "
                             "the job: a rank exited (or hangs) before aiacc.init(); see its output. Ending the job "
                             f"({variable} / aiaccrun --start-timeout sets this limit; 0 waits forever)\n")
            sys.stderr.flush()
            os._exit(1)

    threading.Thread(target=watch, name="aiacc-start-timeout", daemon=True).start()
    provided = ctypes.c_int(0)
    try:
        code = init(None, None, ctypes.c_int(MPI.THREAD_MULTIPLE), ctypes.byref(provided))
    finally:
        started.set()
    if code != 0:
        raise RuntimeError(f"MPI_Init_thread failed with MPI error code {code}")


def _finalize_mpi(MPI, pid: int) -> None:  # noqa: N803 - the module
    """At exit, finalize the MPI that ``import_mpi`` started (mpi4py does not: it did not start it); not in a
    process forked from it (finalizing is collective: its exit hung)."""
    if os.getpid() == pid and MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


def _never() -> bool:
    return False


def _pieces(n: int, size: int):
    """(start, count) of consecutive pieces of at most ``size`` of ``n`` elements (one for n = 0)."""
    return [(s, min(size, n - s)) for s in range(0, n, size)] or [(0, 0)]


def _split(n: int, parts: int):
    """``n`` elements in ``parts`` near-equal blocks (``scatter_rows``' split): (counts, displacements)."""
    counts = scatter_rows(n, parts)
    return counts, [0, *itertools.accumulate(counts[:-1])]


class _Steps:
    """A collective made of several MPI steps, seen as one request: ``Test`` advances it as far as
    the steps posted so far allow (the work between steps runs on the testing thread), ``Wait``
    runs it to the end."""

    __slots__ = ("_steps", "_req")

    def __init__(self, steps):
        self._steps = steps
        self._req = next(steps, None)

    def Test(self) -> bool:  # noqa: N802 - an MPI request's name
        req = self._req
        while req is not None:
            if not req.Test():
                return False
            req = self._req = next(self._steps, None)
        return True

    def Wait(self) -> None:  # noqa: N802
        req = self._req
        while req is not None:
            req.Wait()
            req = self._req = next(self._steps, None)


class MPITransport:
    """Collectives over one mpi4py communicator, on numpy arrays (a ``ControlTransport``)."""

    name = "mpi"

    def __init__(self, comm, on_slow_wait: Optional[Callable[[float], None]] = None):
        self.MPI = import_mpi()
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._user_ops = {}
        self._on_slow_wait = on_slow_wait
        # True while a thread of this rank is blocked on a handle (the engine sets it)
        self.hurry: Callable[[], bool] = _never
        self.achieved_rate: Optional[float] = None  # peak bytes/s of recent large allreduces
        self._large = 0
        self._bf16 = bfloat16_dtype()
        self._sixteen = (np.dtype(np.float16),) + (() if self._bf16 is None else (self._bf16,))
        self._levels = [comm]  # see set_hosts
        MPI = self.MPI
        self._mpi_ops = {
            ReduceOp.SUM: MPI.SUM,
            ReduceOp.AVERAGE: MPI.SUM,
            ReduceOp.MIN: MPI.MIN,
            ReduceOp.MAX: MPI.MAX,
            ReduceOp.PRODUCT: MPI.PROD,
            ReduceOp.BAND: MPI.BAND,
            ReduceOp.BOR: MPI.BOR,
            ReduceOp.BXOR: MPI.BXOR,
        }
        self._bool_ops = {
            ReduceOp.SUM: MPI.LOR,
            ReduceOp.AVERAGE: MPI.LOR,
            ReduceOp.MIN: MPI.LAND,
            ReduceOp.MAX: MPI.LOR,
            ReduceOp.PRODUCT: MPI.LAND,
            ReduceOp.BAND: MPI.LAND,
            ReduceOp.BOR: MPI.LOR,
            ReduceOp.BXOR: MPI.LXOR,
        }
        self._types = {
            np.dtype(np.float16): MPI.FLOAT16_T,
            np.dtype(np.float32): MPI.FLOAT,
            np.dtype(np.float64): MPI.DOUBLE,
            np.dtype(np.int8): MPI.INT8_T,
            np.dtype(np.uint8): MPI.UINT8_T,
            np.dtype(np.int16): MPI.INT16_T,
            np.dtype(np.uint16): MPI.UINT16_T,
            np.dtype(np.int32): MPI.INT32_T,
            np.dtype(np.int64): MPI.INT64_T,
            np.dtype(np.bool_): MPI.C_BOOL,
            # Sum only (requests._check_op refuses the other ops for complex, as torch.distributed does)
            np.dtype(np.complex64): MPI.C_FLOAT_COMPLEX,
            np.dtype(np.complex128): MPI.C_DOUBLE_COMPLEX,
        }

    # ---- lifecycle -------------------------------------------------------------
    def close(self) -> None:
        for op in self._user_ops.values():
            try:
                op.Free()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        self._user_ops.clear()
        try:
            self.comm.Free()
        except Exception:  # noqa: BLE001
            pass

    def set_hosts(self, local_comm, cross_comm, uniform: bool) -> None:
        """The hosts: ``local_comm`` the ranks sharing this rank's memory, ``cross_comm`` the ranks of
        the same local rank on every host; ``uniform``: every host holds as many ranks. Sums of 16-bit
        floats then reduce within the host first and cross between hosts once (``_sum16``)."""
        if uniform:
            self._levels = [c for c in (local_comm, cross_comm) if c.Get_size() > 1] or [self.comm]
        else:
            self._levels = [self.comm]

    # ---- helpers ---------------------------------------------------------------
    def wait_politely(self, req, max_sleep: float = 1e-3) -> None:
        """Wait for a non-blocking request without spinning a whole core for long.

        While a thread of this rank is blocked on a handle (``hurry()``), the core its training
        thread would use is free, and a nap here only delays the result it waits for: the engine
        then polls, yielding the core between polls, for up to HURRY_SPIN_SECONDS. Napping there
        cost a synchronous 4 KiB allreduce ~1.4 ms instead of ~0.2 ms (measured): the rank that
        arrived first overslept the other's arrival, each step, in turn.
        """
        for _ in range(16):  # a peer that is there answers within a few microseconds
            if req.Test():
                return
        delay = 20e-6
        start = time.monotonic()
        next_report = start + 10.0
        hurry = self.hurry
        while not req.Test():
            if hurry() and time.monotonic() - start < HURRY_SPIN_SECONDS:
                os.sched_yield()
                continue
            time.sleep(delay)
            delay = min(delay * 2, max_sleep)
            if self._on_slow_wait is not None:
                now = time.monotonic()
                if now >= next_report:
                    next_report = now + 10.0
                    self._on_slow_wait(now - start)

    def _reduce_spec(self, array: np.ndarray, op: ReduceOp):
        """(buffer spec, MPI op) for a reduction of ``array``."""
        dtype = array.dtype
        if self._bf16 is not None and dtype == self._bf16:
            return [array.view(np.uint16), self.MPI.UINT16_T], self._numpy_op(op, dtype)
        if dtype == np.bool_:
            # MPI defines only logical ops on C_BOOL; these are numpy's results on bool arrays
            # (add and max: or; multiply and min: and)
            return [array, self._types[dtype]], self._bool_ops[op]
        if dtype.kind == "f" and op in (ReduceOp.MIN, ReduceOp.MAX):
            # MPICH's MPI_MAX is `a > b ? a : b`: with a NaN on one rank the result depended on the order each
            # rank combined in (rank 0 got 1.0, rank 1 NaN). numpy's (and gloo's, and the shared window's):
            # NaN wins, on every rank
            return [array, self._types[dtype]], self._numpy_op(op, dtype)
        return [array, self._types[dtype]], self._mpi_ops[op]

    def _numpy_op(self, op: ReduceOp, dtype: np.dtype):
        """A user-defined MPI op that reduces ``dtype`` with numpy's ufunc for ``op``: bfloat16 (MPICH has no
        built-in one; summed in float32, rounded once: what the hardware would do), or NaN-propagating
        min / max of floats."""
        found = self._user_ops.get((op, dtype))
        if found is None:
            ufunc = {
                ReduceOp.SUM: np.add, ReduceOp.AVERAGE: np.add, ReduceOp.MIN: np.minimum,
                ReduceOp.MAX: np.maximum, ReduceOp.PRODUCT: np.multiply,
            }[op]
            if dtype == self._bf16:
                def reduce(inbuf, inoutbuf, datatype):
                    a = np.frombuffer(inbuf, dtype=dtype)
                    b = np.frombuffer(inoutbuf, dtype=dtype)
                    b[...] = ufunc(a.astype(np.float32), b.astype(np.float32)).astype(dtype)
            else:
                def reduce(inbuf, inoutbuf, datatype):
                    b = np.frombuffer(inoutbuf, dtype=dtype)
                    ufunc(np.frombuffer(inbuf, dtype=dtype), b, out=b)

            found = self._user_ops[(op, dtype)] = self.MPI.Op.Create(reduce, commute=True)
        return found

    def synchronize(self) -> None:
        """Host collectives are finished when they return: nothing to wait for."""

    # ---- negotiation -----------------------------------------------------------
    def bitwise_and(self, vec: np.ndarray) -> np.ndarray:
        """Bitwise AND of a uint8 vector across ranks (waits politely)."""
        out = np.empty_like(vec)
        req = self.comm.Iallreduce([vec, self.MPI.UINT8_T], [out, self.MPI.UINT8_T], op=self.MPI.BAND)
        self.wait_politely(req)
        return out

    def allgather_object(self, obj) -> list:
        return self.comm.allgather(obj)

    def allgather_ints(self, values: Sequence[int]) -> np.ndarray:
        """Every rank's ``values`` (same length on all ranks): shape (size, len(values))."""
        send = np.asarray(values, dtype=np.int64)
        recv = np.empty((self.size, send.size), dtype=np.int64)
        self.comm.Allgather([send, self.MPI.INT64_T], [recv, self.MPI.INT64_T])
        return recv

    # ---- data collectives -------------------------------------------------------
    def allreduce(self, send: Optional[np.ndarray], recv: np.ndarray, op: ReduceOp, factor: float = 1.0) -> None:
        """``recv = reduce(send)`` across ranks; ``send=None`` reduces ``recv`` in place. ``factor``: only for a
        ``multi_step`` (16-bit) sum, which applies it before rounding (see ``_sum_blocks16``).

        Always posted non-blocking, whichever way this rank then waits: each rank picks its own
        way from its own measured rate, and MPI never matches a blocking collective with a
        non-blocking one (MPICH then hangs both ranks; seen in CI). Measured here, Iallreduce+Wait
        costs what Allreduce does (16 MiB: 5.5 vs 5.3 ms, 64 MiB: 42.9 vs 43.4).
        """
        if self.multi_step(recv.dtype, op):
            # waits in MPI: a step over shared memory moves data only while MPI is polled (napping between
            # polls made a 32 MB step take 1.2 s instead of 20 ms, measured), and between steps it sums
            self.allreduce_start(send, recv, op, factor).Wait()
            return
        assert factor == 1.0, "only a 16-bit sum applies a factor"
        nbytes = recv.nbytes
        if nbytes > SPIN_WAIT_BYTES:
            start = time.perf_counter()
            req = self.allreduce_start(send, recv, op)
            self._large += 1
            # every 16th large allreduce waits in Wait(), so a peak measured low (a late peer at
            # the start) cannot keep a fast link in polite mode for good
            self._finish(req, self._network_nap(nbytes) if self._large % 16 else None)
            self._observe(nbytes, time.perf_counter() - start)
            return
        req = self.allreduce_start(send, recv, op)
        # Spin for a few times what the transfer takes when every rank is here (each step of the
        # algorithm needs every rank polling; napping between steps multiplied a 64 KiB allreduce's
        # latency by 5, measured), then wait politely: a rank whose engine is late (waiting for the
        # GIL or a core) must not cost the others a spinning core for long. While nobody waits for
        # the result (a bucket sent during backward), the core belongs to training: a short spin only.
        spin = 200e-6 + nbytes / 1e9 if self.hurry() else SPIN_UNHURRIED_SECONDS
        deadline = time.perf_counter() + spin
        while not req.Test():
            if time.perf_counter() > deadline:
                self.wait_politely(req, max_sleep=2e-4)
                return

    def _observe(self, nbytes: int, seconds: float) -> None:
        """Track the best bandwidth large allreduces reach, decaying slowly: the link's speed.

        A peak, not an average: a late peer, or polling itself, only makes a transfer look
        slower, and an average would then keep a fast link in the polite mode that slowed it.
        """
        sample = nbytes / max(seconds, 1e-9)
        rate = self.achieved_rate
        self.achieved_rate = sample if rate is None else max(0.98 * rate, sample)

    def _network_nap(self, nbytes: int) -> Optional[float]:
        """The nap between polls of an ``nbytes`` allreduce over a slow network (about 1/50 of its
        expected time); None where the link is not known to be one (wait in MPI)."""
        rate = self.achieved_rate
        if rate is None or rate >= NETWORK_BYTES_PER_S:
            return None
        return min(5e-4, max(2e-5, nbytes / rate / 50))

    @staticmethod
    def _finish(request, nap: Optional[float]) -> None:
        """Wait in MPI (``nap`` None) or poll with naps of ``nap`` seconds."""
        if nap is None:
            request.Wait()
            return
        while not request.Test():
            time.sleep(nap)

    def multi_step(self, dtype: np.dtype, op) -> bool:
        """True where an allreduce of ``dtype`` with ``op`` runs in several steps (``_sum16``): the
        engine then runs it to the end before it posts anything else, so that every rank posts each
        communicator's steps in the same order."""
        return self.size > 1 and (op == ReduceOp.SUM or op == ReduceOp.AVERAGE) and dtype in self._sixteen

    def _chunked16(self, x: np.ndarray, levels, factor: float):
        """``_sum16`` over consecutive chunks of ``x``, SUM16_WINDOW of them in progress at a time, so that
        one chunk's sums overlap the next chunk's transfer and a previous one's crossing the hosts'
        link. Steps are posted in a fixed round-robin order (each step waited for before its chunk
        posts the next), so every rank posts each communicator's steps in the same order."""
        chunks = (self._sum16(x[s:s + n], levels, factor) for s, n in _pieces(x.size, SUM16_CHUNK_ELEMENTS))
        active = collections.deque()

        def start() -> None:
            for steps in chunks:
                req = next(steps, None)
                if req is not None:
                    active.append((steps, req))
                    return

        for _ in range(SUM16_WINDOW):
            start()
        while active:
            steps, req = active.popleft()
            yield req
            req = next(steps, None)  # the chunk's work between steps, and its next step posted
            if req is not None:
                active.append((steps, req))
            else:
                start()

    def _sum16(self, x: np.ndarray, levels, factor: float = 1.0):
        """Sum a float16 / bfloat16 vector in place across ``levels`` (communicators, the host's ranks
        first): a generator of MPI requests, run by ``_Steps``.

        MPICH reduces ``MPI_FLOAT16_T`` five times slower than float32 (16 M elements, 2 ranks:
        111 vs 23 ms) and bfloat16 needs an op written in Python, so 16-bit sums -- what
        ``Compression.fp16`` / ``.bf16`` send -- only move bytes through MPI: at each level an
        all-to-all gives every rank one block of every peer's vector, the rank sums its block in
        float32 and rounds it once, the blocks travel on to the next level (hosts), and an
        all-gather brings every block back. Each element is summed by one rank, so every rank holds
        the same result. Across hosts each rank sends only its host's sum of its share: a host's
        link carries half of what a float32 allreduce puts on it (the point of compressing). ``factor``
        scales the first level's float32 sums before they are rounded (with one level, the whole sum's)."""
        MPI = self.MPI
        comm = levels[0]
        p, me = comm.Get_size(), comm.Get_rank()
        counts, displs = _split(x.size, p)
        c, d = counts[me], displs[me]
        words = x.view(np.uint16)
        recv = np.empty(p * c, np.uint16)
        yield comm.Ialltoallv([words, (counts, displs), MPI.UINT16_T],
                              [recv, ([c] * p, [i * c for i in range(p)]), MPI.UINT16_T])
        mine = x[d:d + c]
        _sum_blocks16(recv.view(x.dtype).reshape(p, c), mine, factor)
        if len(levels) > 1:
            yield from self._sum16(mine, levels[1:])
        yield comm.Iallgatherv(MPI.IN_PLACE, [words, (counts, displs), MPI.UINT16_T])

    def allreduce_start(self, send: Optional[np.ndarray], recv: np.ndarray, op: ReduceOp, factor: float = 1.0):
        """Post ``allreduce`` without waiting; finish it with ``test`` / ``wait_data``."""
        if self.multi_step(recv.dtype, op):
            if send is not None:
                recv[...] = send
            return _Steps(self._chunked16(recv.reshape(-1), self._levels, factor))
        assert factor == 1.0, "only a 16-bit sum applies a factor"
        spec, mpi_op = self._reduce_spec(recv, op)
        sspec = self.MPI.IN_PLACE if send is None else self._reduce_spec(send, op)[0]
        return self.comm.Iallreduce(sspec, spec, op=mpi_op)

    @staticmethod
    def test(request) -> bool:
        return request.Test()

    def wait_data(self, request, nbytes: int) -> None:
        """Wait for a posted data collective: spinning over memory, napping over a network (and
        with short naps while the link is not measured yet)."""
        self._finish(request, 5e-5 if self.achieved_rate is None else self._network_nap(nbytes))

    def allreduce_hierarchical(self, buf: np.ndarray, op: ReduceOp, local_comm, cross_comm,
                               factor: float = 1.0) -> None:
        """Reduce ``buf`` in place in three steps: to each host's local rank 0, across the hosts'
        local ranks 0, then back to every rank of the host. Same result as ``allreduce``; across
        hosts only one rank per host sends, which is what pays off on a slow inter-host network.
        16-bit sums are hierarchical by themselves (``_sum16``)."""
        if self.multi_step(buf.dtype, op):
            self.allreduce(None, buf, op, factor)
            return
        assert factor == 1.0, "only a 16-bit sum applies a factor"
        spec, mpi_op = self._reduce_spec(buf, op)
        MPI = self.MPI
        if local_comm.Get_size() > 1:
            if local_comm.Get_rank() == 0:
                local_comm.Reduce(MPI.IN_PLACE, spec, op=mpi_op, root=0)
            else:
                local_comm.Reduce(spec, None, op=mpi_op, root=0)
        if local_comm.Get_rank() == 0 and cross_comm.Get_size() > 1:
            cross_comm.Allreduce(MPI.IN_PLACE, spec, op=mpi_op)
        if local_comm.Get_size() > 1:
            local_comm.Bcast([buf.reshape(-1).view(np.uint8), MPI.BYTE], root=0)

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, byte_counts: Sequence[int]) -> None:
        counts = [int(c) for c in byte_counts]
        displs = np.concatenate(([0], np.cumsum(counts[:-1]))).astype(int).tolist()
        self.comm.Allgatherv(
            [send.reshape(-1).view(np.uint8), self.MPI.BYTE],
            [recv.reshape(-1).view(np.uint8), (counts, displs), self.MPI.BYTE],
        )

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        self.comm.Bcast([buf.reshape(-1).view(np.uint8), self.MPI.BYTE], root=root)

    def sendrecv(self, send: np.ndarray, partner: int, recv: np.ndarray) -> None:
        """Exchange ``send`` for ``recv`` with rank ``partner`` (Adasum's pairwise steps)."""
        self.comm.Sendrecv([send.reshape(-1).view(np.uint8), self.MPI.BYTE], partner, 0,
                           [recv.reshape(-1).view(np.uint8), self.MPI.BYTE], partner, 0)

    def alltoallv(self, send: np.ndarray, send_bytes: Sequence[int], recv: np.ndarray, recv_bytes: Sequence[int]) -> None:
        sc = [int(c) for c in send_bytes]
        rc = [int(c) for c in recv_bytes]
        sd = np.concatenate(([0], np.cumsum(sc[:-1]))).astype(int).tolist()
        rd = np.concatenate(([0], np.cumsum(rc[:-1]))).astype(int).tolist()
        self.comm.Alltoallv(
            [send.reshape(-1).view(np.uint8), (sc, sd), self.MPI.BYTE],
            [recv.reshape(-1).view(np.uint8), (rc, rd), self.MPI.BYTE],
        )

    def alltoall_ints(self, values: Sequence[int]) -> np.ndarray:
        send = np.asarray(values, dtype=np.int64)
        recv = np.empty_like(send)
        self.comm.Alltoall([send, self.MPI.INT64_T], [recv, self.MPI.INT64_T])
        return recv

    def reduce_scatter(self, send: np.ndarray, recv: np.ndarray, counts: List[int], op: ReduceOp,
                       factor: float = 1.0) -> None:
        """Reduce ``send`` across ranks; rank i receives the i-th block of ``counts[i]`` elements. ``factor``: as
        for ``allreduce``."""
        if self.multi_step(send.dtype, op):
            self._reduce_scatter16(send.reshape(-1), recv.reshape(-1), [int(c) for c in counts], factor)
            return
        assert factor == 1.0, "only a 16-bit sum applies a factor"
        sspec, mpi_op = self._reduce_spec(send.reshape(-1), op)
        rspec, _ = self._reduce_spec(recv.reshape(-1), op)
        self.comm.Reduce_scatter(sspec, rspec, recvcounts=[int(c) for c in counts], op=mpi_op)

    def _reduce_scatter16(self, x: np.ndarray, out: np.ndarray, counts: List[int], factor: float) -> None:
        """The 16-bit sum of ``reduce_scatter`` as ``_sum16`` does it (MPI's own would round after every
        addition, and differ from the same rows of an allreduce): an all-to-all gives this rank every
        peer's block of it, summed in float32 and rounded once."""
        MPI = self.MPI
        p, c = self.size, counts[self.rank]
        displs = [0, *itertools.accumulate(counts[:-1])]
        recv = np.empty(p * c, np.uint16)
        self.comm.Alltoallv([x.view(np.uint16), (counts, displs), MPI.UINT16_T],
                            [recv, ([c] * p, [i * c for i in range(p)]), MPI.UINT16_T])
        _sum_blocks16(recv.view(x.dtype).reshape(p, c), out, factor)

    def barrier(self) -> None:
        self.wait_politely(self.comm.Ibarrier())

    def abort(self, code: int = 1) -> None:
        """End every rank of the job. mpiexec forwards each rank's output through a pipe and the
        abort can overtake what was written just before it (the traceback that says why), so the
        streams are flushed and the forwarder gets a moment first."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not prevent the abort
                pass
        time.sleep(ABORT_GRACE_SECONDS)
        self.MPI.COMM_WORLD.Abort(code)
