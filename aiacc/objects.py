"""Python objects across ranks (pickled into uint8 arrays); shared by every adapter."""

from __future__ import annotations

import io
import pickle
from typing import Any, List, Optional

import numpy as np

from . import api
from .ops import Average, ReduceOp, as_reduce_op

__all__ = ["broadcast_object", "allgather_object", "average_factors", "gradient_factors"]


def _dumps(obj) -> np.ndarray:
    buf = io.BytesIO()
    pickle.dump(obj, buf, protocol=pickle.HIGHEST_PROTOCOL)
    return np.frombuffer(buf.getbuffer(), dtype=np.uint8).copy()


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None, process_set=None) -> Any:
    """``obj`` of ``root_rank`` (a rank of the job) on every rank of ``process_set`` (any picklable object)."""
    name = name or "broadcast_object"
    payload = _dumps(obj) if api.rank() == root_rank else np.zeros(0, np.uint8)
    length = api.broadcast(np.array([payload.size], np.int64), root_rank, name=f"{name}.size",
                           process_set=process_set)
    if api.rank() != root_rank:
        payload = np.zeros(int(length[0]), np.uint8)
    data = api.broadcast(payload, root_rank, name=f"{name}.data", process_set=process_set)
    return obj if api.rank() == root_rank else pickle.loads(data.tobytes())


def allgather_object(obj: Any, name: Optional[str] = None, process_set=None) -> List[Any]:
    """A list with every rank's ``obj`` (of ``process_set``), in rank order."""
    name = name or "allgather_object"
    payload = _dumps(obj)
    sizes = api.allgather(np.array([payload.size], np.int64), name=f"{name}.size", process_set=process_set)
    data = api.allgather(payload, name=f"{name}.data", process_set=process_set)
    out, start = [], 0
    for n in sizes.tolist():
        out.append(pickle.loads(data[start:start + n].tobytes()))
        start += n
    return out


def average_factors(op, gradient_predivide_factor: float = 1.0):
    """(op, prescale, postscale) for Horovod's ``gradient_predivide_factor``.

    With op=Average the average is split: gradients are divided by the factor before the
    sum and by ``size / factor`` after it. Other ops ignore the factor (as in Horovod).
    """
    op = as_reduce_op(op)
    f = float(gradient_predivide_factor)
    if f <= 0:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor!r} must be > 0")
    if op == ReduceOp.AVERAGE and f != 1.0:
        return Average, 1.0 / f, f
    return op, 1.0, 1.0


def gradient_factors(op, gradient_predivide_factor: float = 1.0, what: str = "DistributedOptimizer",
                     adasum: bool = False):
    """(op, prescale, postscale) of the gradients' reduction by a gradient wrapper ``what``
    (``DistributedOptimizer``, ``DistributedTrainer``, ``DistributedGradientTape``): Average or Sum (and
    Adasum where the wrapper takes it: ``adasum``), ``gradient_predivide_factor`` with Average only
    (Horovod's rules); errors name ``what`` and the argument."""
    op = as_reduce_op(op)
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM) and not (adasum and op == ReduceOp.ADASUM):
        also = ", Sum or Adasum" if adasum else " or Sum"
        raise ValueError(f"{what}: op={op} is not supported for gradients; use Average{also}")
    if op != ReduceOp.AVERAGE and float(gradient_predivide_factor) != 1.0:
        raise ValueError(f"{what}: gradient_predivide_factor={gradient_predivide_factor} applies to op=Average "
                         f"only (got op={op})")
    return average_factors(op, gradient_predivide_factor)
