"""What the engine needs of a transport, as ``typing.Protocol`` classes.

The engine runs two kinds of traffic. Control (the negotiation, counts and
splits, barriers, posting and testing non-blocking allreduces, aborting the
job) always goes over MPI. Data goes over the transport of the array's
device: MPI for host arrays, NCCL for CUDA arrays. Both transports implement
:class:`DataTransport`; the MPI transport also implements
:class:`ControlTransport`.
"""

from __future__ import annotations

from typing import Any, List, Optional, Protocol, Sequence

import numpy as np

from ..ops import ReduceOp

__all__ = ["DataTransport", "ControlTransport"]


class DataTransport(Protocol):
    name: str

    def allreduce(self, send: Optional[Any], recv: Any, op: ReduceOp) -> None:
        """``recv = reduce(send)`` across ranks; ``send=None`` reduces ``recv`` in place."""

    def allreduce_hierarchical(self, buf: Any, op: ReduceOp, local_comm, cross_comm) -> None:
        """In place: within each host, across hosts, then back within the host."""

    def broadcast(self, buf: Any, root: int) -> None: ...

    def allgatherv(self, send: Any, recv: Any, byte_counts: Sequence[int]) -> None: ...

    def alltoallv(self, send: Any, send_bytes: Sequence[int], recv: Any, recv_bytes: Sequence[int]) -> None: ...

    def reduce_scatter(self, send: Any, recv: Any, counts: List[int], op: ReduceOp) -> None: ...

    def synchronize(self) -> None:
        """Return once every operation issued so far has finished (device transports)."""

    def close(self) -> None: ...


class ControlTransport(DataTransport, Protocol):
    """MPI's, which is also the host arrays' data transport. ``factor``: its ``multi_step`` sums (16-bit floats,
    summed in float32 and rounded once) apply Average's 1/n and the postscale before the rounding, so that an
    average is finite wherever it fits 16 bits; every other reduction is given 1.0 (the engine scales after)."""

    def allreduce(self, send: Optional[Any], recv: Any, op: ReduceOp, factor: float = 1.0) -> None: ...

    def reduce_scatter(self, send: Any, recv: Any, counts: List[int], op: ReduceOp, factor: float = 1.0) -> None: ...

    def bitwise_and(self, vec: np.ndarray) -> np.ndarray: ...

    def allgather_object(self, obj) -> list: ...

    def allgather_ints(self, values: Sequence[int]) -> np.ndarray: ...

    def alltoall_ints(self, values: Sequence[int]) -> np.ndarray: ...

    def barrier(self) -> None: ...

    def sendrecv(self, send: np.ndarray, partner: int, recv: np.ndarray) -> None:
        """Exchange host arrays with one rank (Adasum)."""

    def allreduce_start(self, send: Optional[np.ndarray], recv: np.ndarray, op: ReduceOp, factor: float = 1.0):
        """Post an allreduce; finish it with ``test`` / ``wait_data``."""

    def test(self, request) -> bool: ...

    def multi_step(self, dtype: np.dtype, op: ReduceOp) -> bool:
        """True where ``allreduce_start`` of ``dtype`` posts several steps: run it to the end before
        posting anything else."""

    def wait_data(self, request, nbytes: int) -> None: ...

    def abort(self, code: int = 1) -> None:
        """End every rank of the job."""
