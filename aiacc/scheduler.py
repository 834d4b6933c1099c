"""What is sent first: priorities, partitions and credit (the ByteScheduler idea).

Agreed responses enter a queue. Allreduces larger than ``partition_bytes``
are split into partitions that queue separately, so an urgent tensor agreed
later does not wait behind the rest of a big one. Each cycle the engine
takes items, most urgent first, until ``credit_bytes`` are taken; the rest
waits for the next cycle, where newly agreed, more urgent tensors can
overtake it. Priorities come from the adapters: the gradients of layers
near the input are needed first by the next forward pass and get the
highest priority.

The queue holds the same items in the same order on every rank (responses
are identical everywhere), so every rank takes the same items each cycle.
"""

from __future__ import annotations

from typing import List, NamedTuple

from .compression import as_compressor
from .fusion import Piece
from .ops import Collective, ReduceOp
from .tensors import dtype_from_name

__all__ = ["Scheduler", "Queued"]

_ALLREDUCE = int(Collective.ALLREDUCE)
_ADASUM = int(ReduceOp.ADASUM)  # never fused: it combines tensor by tensor (Executor._run_single)


class Queued(NamedTuple):
    """One item in the queue. Compared as a tuple, most urgent first: (seq, part) is unique, so the
    comparison never reaches the item."""

    neg_priority: float
    seq: int  # agreement order
    part: int  # partition index within its tensor
    nbytes: int
    item: object  # a Piece, a list of Pieces (a group) or a Response of another collective


class Scheduler:
    def __init__(self, priority: bool = True, partition_bytes: int = 0, credit_bytes: int = 0):
        self.priority = priority
        self.partition_bytes = partition_bytes
        self.credit_bytes = credit_bytes
        self._items: List[Queued] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._items)

    def push(self, responses) -> None:
        """Queue agreed responses (in their agreed order)."""
        items = self._items
        use_priority = self.priority
        for resp in responses:
            self._seq += 1
            seq = self._seq
            prio = -resp.priority if use_priority else 0.0
            if resp.error is None and resp.meta.kind == _ALLREDUCE and resp.meta.op != _ADASUM:
                req = resp.request
                if req is not None and req.single and req.outputs is not None and not self.partition_bytes:
                    # the common case, inlined: one whole tensor with its output given
                    src = req.flat_inputs[0]
                    piece = Piece(resp, 0, 0, src.size, req.dtypes[0], req.wires[0], src, req.flat_outputs[0])
                    items.append(Queued(prio, seq, 0, piece.count * piece.wire.itemsize, piece))
                    continue
                pieces = self._pieces(resp)
                if resp.request is not None:
                    resp.request.remaining = len(pieces)
                if len(pieces) == 1:
                    items.append(Queued(prio, seq, 0, pieces[0].nbytes, pieces[0]))
                elif len(resp.meta.entries) > 1:  # a group travels as one unit
                    items.append(Queued(prio, seq, 0, sum(p.nbytes for p in pieces), pieces))
                else:
                    for i, p in enumerate(pieces):
                        items.append(Queued(prio, seq, i, p.nbytes, p))
            else:
                items.append(Queued(prio, seq, 0, 0, resp))

    def _pieces(self, resp) -> List[Piece]:
        req = resp.request
        if req is not None:
            req.ensure_outputs()
        entries = resp.meta.entries
        pieces = []
        for index, (dtype_name, shape) in enumerate(entries):
            if req is not None:
                dtype, wire = req.dtypes[index], req.wires[index]
                src, dst = req.flat_inputs[index], req.flat_outputs[index]
                count = src.size
            else:  # a joined rank: it contributes the op's identity, in the agreed shape and wire dtype
                dtype = dtype_from_name(dtype_name)
                wire = as_compressor(resp.meta.compression).wire_dtype(dtype)
                src = dst = None
                count = 1
                for s in shape:
                    count *= s
            step = count
            if self.partition_bytes > 0 and len(entries) == 1:
                step = max(1, self.partition_bytes // dtype.itemsize)
            if step >= count:
                pieces.append(Piece(resp, index, 0, count, dtype, wire, src, dst))
                continue
            for start in range(0, count, step):
                n = min(step, count - start)
                pieces.append(Piece(resp, index, start, n, dtype, wire,
                                    None if src is None else src[start:start + n],
                                    None if dst is None else dst[start:start + n]))
        return pieces

    def take(self, everything: bool = False) -> list:
        """Items to send this cycle, most urgent first, up to the credit."""
        items = self._items
        if self.priority and len(items) > 1:
            items.sort()
        credit = self.credit_bytes
        if everything or credit <= 0:
            self._items = []
            return [it.item for it in items]
        taken, n = 0, 0
        while n < len(items) and (n == 0 or taken < credit):
            taken += items[n].nbytes
            n += 1
        self._items = items[n:]
        return [it.item for it in items[:n]]
