"""NCCL transport for CUDA arrays (cupy's NCCL bindings: ``pip install 'aiacc[gpu]'``).

The NCCL unique id is made on rank 0 and broadcast over the engine's MPI
communicator; every rank then joins one NCCL communicator on its local GPU.
All NCCL calls run on the CUDA legacy default stream, which is the stream
PyTorch and CuPy compute on by default: gradients produced there are ready
before our kernels start, and work queued afterwards waits for ours. The
engine synchronises the stream before it completes a handle, so a result
is never read on the host or another stream before it is final.

Collectives NCCL lacks with uneven counts are built from grouped calls:
allgather with different first dimensions is one broadcast per rank, the
alltoall is paired send/recv, reduce-scatter with uneven blocks is one
reduce per block.
"""

from __future__ import annotations

import socket
from typing import Hashable, List, Optional, Sequence, Tuple

import numpy as np

from ..compression import bfloat16_dtype
from ..ops import ReduceOp

__all__ = ["NCCLTransport", "cupy_or_none", "shared_device"]


def cupy_or_none():
    """cupy if it is installed and a CUDA device is usable, else None (never raises)."""
    try:
        import cupy  # noqa: PLC0415 - optional GPU dependency

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        return cupy
    except Exception:  # noqa: BLE001 - no cupy, no driver, no device
        return None


def shared_device(devices: Sequence[Hashable]) -> Optional[Tuple[int, int]]:
    """The first two ranks whose entries in ``devices`` (one per rank: host and GPU) are equal, else None."""
    first = {}
    for rank, device in enumerate(devices):
        if device in first:
            return first[device], rank
        first[device] = rank
    return None


class NCCLTransport:
    """Collectives on cupy arrays over one NCCL communicator (all ranks of the engine)."""

    name = "nccl"

    def __init__(self, mpi_comm, local_rank: int, local_comm=None):
        import cupy  # noqa: PLC0415
        from cupy.cuda import nccl  # noqa: PLC0415

        self.cupy = cupy
        self.nccl = nccl
        self.device = cupy.cuda.Device(local_rank % cupy.cuda.runtime.getDeviceCount())
        self.device.use()
        self.stream = cupy.cuda.Stream.null
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self._one_gpu_per_rank(mpi_comm)
        self.comm = self._join(mpi_comm)
        # within-host communicator for the hierarchical allreduce
        self.local = self._join(local_comm) if local_comm is not None and local_comm.Get_size() > 1 else None
        self._cross = None
        bf16 = bfloat16_dtype()
        self._types = {
            np.dtype(np.float16): nccl.NCCL_FLOAT16, np.dtype(np.float32): nccl.NCCL_FLOAT32,
            np.dtype(np.float64): nccl.NCCL_FLOAT64, np.dtype(np.int8): nccl.NCCL_INT8,
            np.dtype(np.uint8): nccl.NCCL_UINT8, np.dtype(np.int32): nccl.NCCL_INT32,
            np.dtype(np.int64): nccl.NCCL_INT64, np.dtype(np.bool_): nccl.NCCL_UINT8,
            # NCCL has no complex type: a complex element is summed as its two reals (Sum / Average only)
            np.dtype(np.complex64): nccl.NCCL_FLOAT32, np.dtype(np.complex128): nccl.NCCL_FLOAT64,
        }
        if bf16 is not None:
            self._types[bf16] = nccl.NCCL_BFLOAT16
        self._ops = {ReduceOp.SUM: nccl.NCCL_SUM, ReduceOp.AVERAGE: nccl.NCCL_SUM, ReduceOp.MIN: nccl.NCCL_MIN,
                     ReduceOp.MAX: nccl.NCCL_MAX, ReduceOp.PRODUCT: nccl.NCCL_PROD}

    def _one_gpu_per_rank(self, mpi_comm) -> None:
        """NCCL refuses two ranks of one communicator on the same GPU (ncclInvalidUsage, "invalid usage"):
        say which ranks share which GPU, and what to do, before it does."""
        devices = mpi_comm.allgather((socket.gethostname(), self.device.pci_bus_id))
        pair = shared_device(devices)
        if pair is not None:
            a, b = pair
            host, gpu = devices[a]
            raise RuntimeError(
                f"aiacc: ranks {a} and {b} both use CUDA device {gpu} on host {host}, and NCCL needs a GPU of "
                "its own for every rank: start at most as many ranks per host as it has GPUs (each rank takes "
                "GPU local_rank % count), or give each rank its own GPU with CUDA_VISIBLE_DEVICES")

    def _join(self, mpi_comm):
        uid = self.nccl.get_unique_id() if mpi_comm.Get_rank() == 0 else None
        uid = mpi_comm.bcast(uid, root=0)
        return self.nccl.NcclCommunicator(mpi_comm.Get_size(), uid, mpi_comm.Get_rank())

    def close(self) -> None:
        for c in (self.comm, self.local):
            if c is not None:
                c.destroy()
        self.comm = self.local = None

    def synchronize(self) -> None:
        self.stream.synchronize()

    def _dtype(self, a):
        try:
            return self._types[np.dtype(a.dtype)]
        except KeyError:
            raise TypeError(f"NCCL cannot carry dtype {a.dtype}") from None

    @staticmethod
    def _reals(a) -> int:
        """How many NCCL elements one element of ``a`` is: 2 for complex (its real and imaginary parts), else 1."""
        return 2 if a.dtype.kind == "c" else 1

    def _bytes(self, a):
        return a.reshape(-1).view(self.cupy.uint8)

    # ---- collectives ------------------------------------------------------------------
    def allreduce(self, send, recv, op: ReduceOp) -> None:
        src = recv if send is None else send
        self.comm.allReduce(src.data.ptr, recv.data.ptr, recv.size * self._reals(recv), self._dtype(recv),
                            self._ops[ReduceOp(op)], self.stream.ptr)

    def allreduce_hierarchical(self, buf, op: ReduceOp, local_comm, cross_comm) -> None:
        """NCCL within the host, MPI across hosts (through host memory), NCCL back within the host."""
        nccl_op, dtype, count = self._ops[ReduceOp(op)], self._dtype(buf), buf.size * self._reals(buf)
        if self.local is not None:
            self.local.reduce(buf.data.ptr, buf.data.ptr, count, dtype, nccl_op, 0, self.stream.ptr)
        if local_comm.Get_rank() == 0 and cross_comm.Get_size() > 1:
            if self._cross is None:
                from .mpi import MPITransport  # noqa: PLC0415

                self._cross = MPITransport(cross_comm)  # the engine owns (and frees) cross_comm
            self.stream.synchronize()
            host = self.cupy.asnumpy(buf)
            self._cross.allreduce(None, host, op)
            buf.set(host)
        if self.local is not None:
            self.local.bcast(buf.data.ptr, count, dtype, 0, self.stream.ptr)

    def broadcast(self, buf, root: int) -> None:
        b = self._bytes(buf)
        self.comm.bcast(b.data.ptr, b.size, self.nccl.NCCL_UINT8, root, self.stream.ptr)

    def allgatherv(self, send, recv, byte_counts: Sequence[int]) -> None:
        out = self._bytes(recv)
        src = self._bytes(send)
        counts = [int(c) for c in byte_counts]
        if len(set(counts)) == 1:
            self.comm.allGather(src.data.ptr, out.data.ptr, counts[0], self.nccl.NCCL_UINT8, self.stream.ptr)
            return
        self.nccl.groupStart()
        start = 0
        for r, n in enumerate(counts):
            block = out[start:start + n]
            if n:
                self.comm.broadcast(src.data.ptr, block.data.ptr, n, self.nccl.NCCL_UINT8, r, self.stream.ptr)
            start += n
        self.nccl.groupEnd()

    def alltoallv(self, send, send_bytes: Sequence[int], recv, recv_bytes: Sequence[int]) -> None:
        s, r = self._bytes(send), self._bytes(recv)
        so = np.concatenate(([0], np.cumsum(send_bytes)))
        ro = np.concatenate(([0], np.cumsum(recv_bytes)))
        self.nccl.groupStart()
        for peer in range(self.size):
            if send_bytes[peer]:
                self.comm.send(s[so[peer]:so[peer + 1]].data.ptr, int(send_bytes[peer]), self.nccl.NCCL_UINT8, peer,
                               self.stream.ptr)
            if recv_bytes[peer]:
                self.comm.recv(r[ro[peer]:ro[peer + 1]].data.ptr, int(recv_bytes[peer]), self.nccl.NCCL_UINT8, peer,
                               self.stream.ptr)
        self.nccl.groupEnd()

    def reduce_scatter(self, send, recv, counts: List[int], op: ReduceOp) -> None:
        flat = send.reshape(-1)
        dtype, nccl_op, k = self._dtype(send), self._ops[ReduceOp(op)], self._reals(send)
        if len(set(counts)) == 1:
            self.comm.reduceScatter(flat.data.ptr, recv.data.ptr, counts[0] * k, dtype, nccl_op, self.stream.ptr)
            return
        self.nccl.groupStart()
        start = 0
        for r, n in enumerate(counts):
            if n:
                dst = recv.data.ptr if r == self.rank else flat[start:start + n].data.ptr
                self.comm.reduce(flat[start:start + n].data.ptr, dst, n * k, dtype, nccl_op, r, self.stream.ptr)
            start += n
        self.nccl.groupEnd()
