"""What is sent first: priorities, partitions and credit (the ByteScheduler idea).

Agreed responses enter a priority queue. Allreduces larger than
``partition_bytes`` are split into partitions that queue separately, so an
urgent tensor agreed later does not wait behind the rest of a big one. Each
cycle the engine takes items from the queue, most urgent first, until
``credit_bytes`` are taken; the rest waits for the next cycle, where newly
agreed, more urgent tensors can overtake it. Priorities come from the
adapters: the gradients of layers near the input are needed first by the
next forward pass and get the highest priority.

The queue holds the same items in the same order on every rank (responses
are identical everywhere), so every rank takes the same items each cycle.
"""

from __future__ import annotations

import heapq
from typing import List

import numpy as np

from .fusion import Piece
from .ops import Collective
from .tensors import dtype_from_name

__all__ = ["Scheduler"]


def _entry_count(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class Scheduler:
    def __init__(self, priority: bool = True, partition_bytes: int = 0, credit_bytes: int = 0):
        self.priority = priority
        self.partition_bytes = partition_bytes
        self.credit_bytes = credit_bytes
        self._heap: list = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, responses) -> None:
        """Queue agreed responses (in their agreed order)."""
        for resp in responses:
            self._seq += 1
            key = -resp.priority if self.priority else 0.0
            if resp.error is None and resp.meta.kind == Collective.ALLREDUCE:
                pieces = self._pieces(resp)
                if resp.request is not None:
                    resp.request.remaining = len(pieces)
                if len(resp.meta.entries) > 1:  # a group travels as one unit
                    heapq.heappush(self._heap, (key, self._seq, 0, sum(p.nbytes for p in pieces), pieces))
                else:
                    for i, p in enumerate(pieces):
                        heapq.heappush(self._heap, (key, self._seq, i, p.nbytes, [p]))
            else:
                heapq.heappush(self._heap, (key, self._seq, 0, 0, resp))

    def _pieces(self, resp) -> List[Piece]:
        pieces = []
        for index, (dtype_name, shape) in enumerate(resp.meta.entries):
            dtype = resp.request.dtypes[index] if resp.request is not None else dtype_from_name(dtype_name)
            count = _entry_count(shape)
            step = count
            if self.partition_bytes > 0 and len(resp.meta.entries) == 1:
                step = max(1, self.partition_bytes // dtype.itemsize)
            start = 0
            while True:
                n = min(step, count - start)
                pieces.append(Piece(resp, index, start, n, dtype, shape))
                start += n
                if start >= count:
                    break
        return pieces

    def take(self, everything: bool = False) -> list:
        """Items to send this cycle, most urgent first, up to the credit."""
        out = []
        taken = 0
        credit = self.credit_bytes
        while self._heap:
            if out and credit > 0 and not everything and taken >= credit:
                break
            _, _, _, nbytes, item = heapq.heappop(self._heap)
            out.append(item)
            taken += nbytes
        return out
