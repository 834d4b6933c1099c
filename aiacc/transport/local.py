"""The transport of a job of one rank: what aiacc runs on when it is switched off.

With ``AIACC_ENABLE`` unset or 0 a process is rank 0 of 1 and MPI is never
started. Its collectives still go through the engine's own request checks and
executor (so ops, scale factors, compression and argument checks behave as
in a real job of one rank); only the communication is this transport, where
every collective's result is this rank's own contribution.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from .. import devices
from ..ops import ReduceOp

__all__ = ["LocalTransport"]


def _copy(dst, src) -> None:
    devices.array_module(devices.device_of(dst)).copyto(dst, src)


def _bytes(a):
    return a.reshape(-1).view(np.uint8)


class LocalTransport:
    """Collectives of a job of one rank (a ``ControlTransport``)."""

    name = "local"
    rank, size = 0, 1

    # ---- data -------------------------------------------------------------------------
    def allreduce(self, send, recv, op: ReduceOp) -> None:
        if send is not None:
            _copy(recv, send)

    def allreduce_start(self, send, recv, op: ReduceOp):
        self.allreduce(send, recv, op)
        return None

    def allreduce_hierarchical(self, buf, op: ReduceOp, local_comm, cross_comm) -> None:
        pass

    @staticmethod
    def multi_step(dtype, op: ReduceOp) -> bool:
        return False

    def broadcast(self, buf, root: int) -> None:
        pass

    def allgatherv(self, send, recv, byte_counts: Sequence[int]) -> None:
        _copy(_bytes(recv), _bytes(send))

    def alltoallv(self, send, send_bytes: Sequence[int], recv, recv_bytes: Sequence[int]) -> None:
        _copy(_bytes(recv), _bytes(send))

    def reduce_scatter(self, send, recv, counts: List[int], op: ReduceOp) -> None:
        _copy(recv.reshape(-1), send.reshape(-1)[:counts[0]])

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        pass

    # ---- control ----------------------------------------------------------------------
    @staticmethod
    def test(request) -> bool:
        return True

    def wait_data(self, request, nbytes: int) -> None:
        pass

    def bitwise_and(self, vec: np.ndarray) -> np.ndarray:
        return vec.copy()

    def allgather_object(self, obj) -> list:
        return [obj]

    def allgather_ints(self, values: Sequence[int]) -> np.ndarray:
        return np.asarray(values, dtype=np.int64).reshape(1, -1)

    def alltoall_ints(self, values: Sequence[int]) -> np.ndarray:
        return np.asarray(values, dtype=np.int64).copy()

    def barrier(self) -> None:
        pass

    def abort(self, code: int = 1) -> None:
        raise SystemExit(code)

    hurry: Optional[object] = None
