"""Reduction operations and collective kinds, shared by the core and every adapter."""

import enum
import numbers

__all__ = ["ReduceOp", "Average", "Sum", "Min", "Max", "Product", "Adasum", "Collective", "as_reduce_op",
           "average_or_op", "scatter_rows", "check_sparse_op", "reducescatter_grad_scale"]


class ReduceOp(enum.IntEnum):
    """How ``allreduce`` / ``reducescatter`` combine the ranks' tensors."""

    AVERAGE = 0
    SUM = 1
    MIN = 2
    MAX = 3
    PRODUCT = 4
    ADASUM = 5  # Horovod's Adasum: named so that scripts import, refused by every collective
    BAND = 6  # bitwise and / or / xor of integer (and bool) tensors: torch.distributed's ReduceOps
    BOR = 7
    BXOR = 8

    def __str__(self) -> str:
        return self.name.capitalize()


BITWISE = frozenset((ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR))

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM


class Collective(enum.IntEnum):
    """What a request asks the engine to do."""

    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    ALLTOALL = 3
    REDUCESCATTER = 4
    BARRIER = 5
    JOIN = 6

    def __str__(self) -> str:
        return self.name.lower()


def as_reduce_op(op) -> ReduceOp:
    """Accept a ReduceOp, its whole-number value or its name ("sum", "Average", ...). Anything
    else (a float such as 1.9, a bool, an unknown name or number) is an error naming it."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return ReduceOp[op.strip().upper()]
        except KeyError:
            pass
    elif isinstance(op, numbers.Integral) and not isinstance(op, bool):
        try:
            return ReduceOp(int(op))
        except ValueError:
            pass
    raise ValueError(f"op={op!r} is not a reduce operation; use one of Average, Sum, Min, Max, Product "
                     "(or, for integer tensors, ReduceOp.BAND, BOR, BXOR: 'band', 'bor', 'bxor')")


def average_or_op(average, op, fn: str) -> ReduceOp:
    """Horovod's allreduce arguments: the deprecated ``average=`` flag or ``op=`` (exclusive;
    Average when neither is given). ``fn`` names the call in the error."""
    if average is not None:
        if op is not None:
            raise ValueError(f"{fn}: pass either op= or the deprecated average=, not both")
        return Average if average else Sum
    return Average if op is None else as_reduce_op(op)


def scatter_rows(rows: int, size: int) -> list:
    """How many of ``rows`` rows each of ``size`` ranks keeps after a reducescatter: equal blocks in rank
    order, the first ``rows % size`` ranks one row more (Horovod's split). The engine splits by it, and an
    adapter that must know a result's shape before it runs (TensorFlow's graphs) asks it too."""
    base, extra = divmod(int(rows), int(size))
    return [base + (1 if r < extra else 0) for r in range(size)]


def check_sparse_op(op, what: str, prescale: float = 1.0, postscale: float = 1.0) -> "ReduceOp":
    """The op of a sparse tensor's reduction (torch's sparse COO tensors, TensorFlow's IndexedSlices), which is
    an allgather of its indices and values, Horovod's way: Average or Sum only, no scale factors.
    NotImplementedError naming ``what`` otherwise (Horovod's class), in every adapter."""
    op = as_reduce_op(op)
    if op == ReduceOp.ADASUM:
        raise NotImplementedError(f"{what}: the Adasum reduction does not support sparse tensors; pass "
                                  "sparse_as_dense=True or make the tensor dense")
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise NotImplementedError(f"{what}: op={op} is not supported with sparse tensors: only Sum and Average "
                                  "are (they are allgathered); make the tensor dense to use other ops")
    if float(prescale) != 1.0 or float(postscale) != 1.0:
        raise NotImplementedError(f"{what}: prescale_factor and postscale_factor are not supported with sparse "
                                  "tensors")
    return op


def reducescatter_grad_scale(op, size: int, prescale: float = 1.0, postscale: float = 1.0) -> float:
    """Horovod's factor on the gradient of a reducescatter (the upstream gradient allgathered over ``size``
    ranks): ``size`` for Sum, times the scale factors, so that, as for allreduce, it is the average over ranks."""
    return (size if op == ReduceOp.SUM else 1) * float(prescale) * float(postscale)
