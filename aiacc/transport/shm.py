"""Allreduce of fusion buffers through a shared-memory window, among the ranks of one host.

Over shared memory, MPICH's allreduce copies each rank's buffer into shared cells, reduces there and copies
the result back: with a fusion buffer around it (packed from the tensors, unpacked into them) the data is
copied four times where two passes suffice. Here every rank of the host maps one MPI-3 shared window
(``MPI.Win.Allocate_shared``) holding a slot per rank and a result slot. The engine packs a bucket straight
into this rank's slot; after a barrier each rank reduces its share of the elements over every rank's slot
into the result slot (in rank order, so every element is reduced the same way whichever rank does it) and
scales it (Average, postscale); after a second barrier every rank unpacks its tensors from the result
slot. Measured on this 2-core machine, 2 ranks, 4 MB of float32: pack, MPI ``Allreduce`` in place and
unpack 0.73 ms; pack, the barriers and shares here, and unpack 0.38 ms.

The result slot stays valid until the next reduction: that one's first barrier is passed only when every
rank has finished unpacking this one (each rank unpacks before it packs again). Buckets larger than a
slot, 16-bit floats (``_sum16``), bool, and the bitwise ops keep to MPI.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Optional

import numpy as np

from ..ops import ReduceOp, scatter_rows

__all__ = ["SharedAllreduce", "shared_window_room"]

logger = logging.getLogger("aiacc")

_UFUNCS = {
    int(ReduceOp.SUM): np.add, int(ReduceOp.AVERAGE): np.add, int(ReduceOp.MIN): np.minimum,
    int(ReduceOp.MAX): np.maximum, int(ReduceOp.PRODUCT): np.multiply,
}
_KINDS = "fiuc"  # floats of 32 and 64 bits (16-bit ones sum in float32 elsewhere), integers, complex (Sum)
_LINE = 64  # bytes: a rank's share of the elements starts on a cache line of its own
# How long a barrier spins for the other ranks before it waits politely (MPITransport._wait): the first
# barrier of a reduction meets ranks that packed the same bucket, the second ranks that reduced equal shares.
# While no thread of the rank waits for the result (a bucket sent during backward) the core is training's.
SPIN_SECONDS = 200e-6
SPIN_UNHURRIED_SECONDS = 30e-6


def shared_window_room(nbytes: int, path: str = "/dev/shm") -> bool:
    """Whether ``path`` (where MPICH maps shared windows) has room for ``nbytes`` twice over: a window that
    outgrows it kills the job with SIGBUS when its pages are first touched, with no message."""
    try:
        st = os.statvfs(path)
    except OSError:
        return True  # no /dev/shm to look at: MPICH maps anonymous shared memory
    return st.f_bavail * st.f_frsize >= 2 * nbytes


class SharedAllreduce:
    """The reductions of one host's ranks through a shared window of ``(ranks + 1) * slot_bytes``.

    ``comm``: the host's ranks (every rank of the job: one host); ``wait(request)``: how a rank waits
    politely for an MPI request, ``hurry()``: whether a thread of this rank waits for a result (the
    transport's). Collective: every rank calls ``reduce`` for the same buckets in the same order, as
    with MPI's allreduce.
    """

    def __init__(self, comm, slot_bytes: int, wait: Callable, hurry: Callable[[], bool]):
        from .mpi import import_mpi  # noqa: PLC0415

        MPI = import_mpi()
        self.comm = comm.Dup()  # its barriers never meet another collective of the engine's
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.slot_bytes = slot_bytes = (int(slot_bytes) // _LINE) * _LINE
        self._wait = wait
        self._hurry = hurry
        total = (self.size + 1) * slot_bytes
        self.win = MPI.Win.Allocate_shared(total if self.rank == 0 else 0, 1, comm=self.comm)
        buf, _ = self.win.Shared_query(0)
        self._mem = np.frombuffer(buf, dtype=np.uint8, count=total)
        self.win.Lock_all(MPI.MODE_NOCHECK)  # an access epoch for Sync (memory barriers) from now on
        self._views = {}  # dtype -> (slots as rows of that dtype, result row)
        self.reductions = 0

    def fits(self, dtype: np.dtype, count: int, op: int) -> bool:
        """Whether a bucket of ``count`` elements of ``dtype`` reduced with ``op`` goes through the window."""
        return count * dtype.itemsize <= self.slot_bytes and dtype.kind in _KINDS and dtype.itemsize >= 4 \
            and op in _UFUNCS

    def _rows(self, dtype: np.dtype):
        found = self._views.get(dtype)
        if found is None:
            per = self.slot_bytes // dtype.itemsize
            rows = self._mem.view(dtype).reshape(self.size + 1, per)
            found = self._views[dtype] = (rows, rows[self.size])
        return found

    def slot(self, dtype: np.dtype, count: int) -> np.ndarray:
        """This rank's slot, as ``count`` elements of ``dtype``: pack the bucket here."""
        return self._rows(dtype)[0][self.rank, :count]

    def reduce(self, dtype: np.dtype, count: int, op: int, finish: Optional[Callable]) -> np.ndarray:
        """Reduce every rank's slot (``count`` elements of ``dtype``, packed) into the result slot and
        return it; ``finish(share)`` scales a share of the result in place before the others read it."""
        rows, result = self._rows(dtype)
        self._barrier()  # every slot is packed
        per_line = _LINE // dtype.itemsize
        lines = -(-count // per_line)
        shares = scatter_rows(lines, self.size)
        lo = sum(shares[:self.rank]) * per_line
        hi = min(count, lo + shares[self.rank] * per_line)
        if hi > lo:
            ufunc = _UFUNCS[op]
            out = result[lo:hi]
            ufunc(rows[0, lo:hi], rows[1, lo:hi], out=out)
            for k in range(2, self.size):
                ufunc(out, rows[k, lo:hi], out=out)
            if finish is not None:
                finish(out)
        self._barrier()  # every share is reduced: the result is whole
        self.reductions += 1
        return result[:count]

    def _barrier(self) -> None:
        win = self.win
        win.Sync()  # this rank's stores are visible before the others pass the barrier
        req = self.comm.Ibarrier()
        deadline = time.perf_counter() + (SPIN_SECONDS if self._hurry() else SPIN_UNHURRIED_SECONDS)
        while not req.Test():
            if time.perf_counter() > deadline:
                self._wait(req)
                break
        win.Sync()  # and the others' stores to this rank after it

    def close(self) -> None:
        """Free the window (collective over the host's ranks: at an orderly shutdown only)."""
        try:
            self.win.Unlock_all()
            self.win.Free()
            self.comm.Free()
        except Exception:  # noqa: BLE001 - best effort at shutdown
            logger.debug("aiacc: freeing the shared-memory window failed", exc_info=True)
