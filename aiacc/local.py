"""aiacc switched off: this process is rank 0 of a job of one rank.

With ``AIACC_ENABLE`` unset or 0, ``init()`` starts neither MPI nor a thread,
and every collective runs at once, on the caller's thread, through the same
request checks and executor as the engine's (so ops, scale factors,
compression and argument checks behave exactly as in a real job of one rank;
an error there is an error here), with :class:`LocalTransport` in place of
communication.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from .execution import Executor
from .fusion import plan
from .negotiation import Response
from .ops import Collective, ReduceOp
from .requests import Request, RequestFactory
from .scheduler import Scheduler
from .transport.local import LocalTransport

__all__ = ["OneRankJob"]


class OneRankJob:
    """``submit()`` with the engine's signature, completed before it returns."""

    rank, size = 0, 1

    def __init__(self):
        self.transport = LocalTransport()
        self.requests = RequestFactory(0, 1, None)
        self.executor = Executor(0, 1, self.transport, lambda _device: self.transport, self._complete,
                                 collections.Counter())
        self._lock = threading.Lock()  # one executor, callers on any thread

    @staticmethod
    def _complete(req: Request, result, error, _t_done=None) -> None:
        req._set(result, error)

    def submit(self, kind, arrays, *, name: Optional[str] = None, op=ReduceOp.AVERAGE, root: int = 0,
               prescale: float = 1.0, postscale: float = 1.0, compression=None, priority: float = 0.0,
               outputs: Optional[Sequence[np.ndarray]] = None, splits=None, allocate: Optional[Callable] = None,
               labels: Tuple[str, ...] = ()) -> Request:
        req = self.requests.make(kind, arrays, name, op, root, prescale, postscale, compression, priority, outputs,
                                 splits, allocate, labels)
        resp = Response(req.name, req.meta, req.priority, req)
        if req.kind == Collective.JOIN:
            resp.last_joined = 0  # the only rank, and so the last to join
        scheduler = Scheduler(True, 0, 0)
        scheduler.push([resp])
        with self._lock:
            self.executor.execute(plan(scheduler.take(), 1 << 62), pipelined=False)
        return req
