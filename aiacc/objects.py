"""Python objects across ranks (pickled into uint8 arrays); shared by every adapter."""

from __future__ import annotations

import io
import math
import numbers
import pickle
from typing import Any, List, Optional

import cloudpickle
import numpy as np

from . import api
from .exceptions import TensorMismatchError
from .names import describe, only_on_some_ranks
from .ops import Average, ReduceOp, as_reduce_op

__all__ = ["check_passes", "broadcast_object", "allgather_object", "check_same_keys", "average_factors", "gradient_factors",
           "check_groups"]


def _dumps(obj) -> np.ndarray:
    """``obj`` pickled with cloudpickle, as Horovod's object collectives do (lambdas, closures, classes defined
    in a function travel too; any rank loads it with plain ``pickle``)."""
    buf = io.BytesIO()
    cloudpickle.dump(obj, buf, protocol=pickle.HIGHEST_PROTOCOL)
    return np.frombuffer(buf.getbuffer(), dtype=np.uint8).copy()


def _try_dumps(obj):
    """(payload, None), or (an empty payload, the exception) when ``obj`` cannot be pickled: the ranks then
    learn it from its size (-1) and all raise, instead of some waiting for data that never comes."""
    try:
        return _dumps(obj), None
    except Exception as exc:  # noqa: BLE001 - whatever pickling raises is reported on every rank
        return np.zeros(0, np.uint8), exc


def _unpicklable(what: str, name: str, ranks: List[int], mine: Optional[BaseException]) -> ValueError:
    text = (f"{what} {name!r}: the object of rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
            "cannot be pickled" + (f" ({type(mine).__name__}: {mine})" if mine is not None else ""))
    return ValueError(text)


def _loads(data: np.ndarray, what: str, name: str, sender: int):
    """The object ``sender`` (a rank of the job) pickled into ``data``; an error naming the call, the sender and this
    rank when it cannot be unpickled here (a class of a module this rank cannot import: other code, another path)."""
    try:
        return pickle.loads(data.tobytes())
    except Exception as exc:  # noqa: BLE001 - whatever unpickling raises, named
        raise ValueError(f"{what} {name!r}: the object of rank {sender} cannot be unpickled on rank {api.rank()} "
                         f"({type(exc).__name__}: {exc}); every rank must be able to import what it refers to") \
            from exc


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None, process_set=None) -> Any:
    """``obj`` of ``root_rank`` (a rank of the job) on every rank of ``process_set`` (any object cloudpickle
    pickles)."""
    name = name or "broadcast_object"
    api._need("broadcast_object")
    root = api.rank() == root_rank
    payload, failed = _try_dumps(obj) if root else (np.zeros(0, np.uint8), None)
    length = api.broadcast(np.array([payload.size if failed is None else -1], np.int64), root_rank,
                           name=f"{name}.size", process_set=process_set)
    if int(length[0]) < 0:
        raise _unpicklable("broadcast_object", name, [root_rank], failed) from failed
    if not root:
        payload = np.zeros(int(length[0]), np.uint8)
    data = api.broadcast(payload, root_rank, name=f"{name}.data", process_set=process_set)
    return obj if root else _loads(data, "broadcast_object", name, root_rank)


def members_of(process_set, count: int) -> List[int]:
    """The job ranks of ``process_set``'s members, in set-rank order (every rank when None): who sent each of the
    ``count`` rows a collective of that set gathered."""
    return list(range(count)) if process_set is None else list(getattr(process_set, "ranks", None) or range(count))


def allgather_object(obj: Any, name: Optional[str] = None, process_set=None) -> List[Any]:
    """A list with every rank's ``obj`` (of ``process_set``), in rank order."""
    name = name or "allgather_object"
    api._need("allgather_object")
    payload, failed = _try_dumps(obj)
    sizes = api.allgather(np.array([payload.size if failed is None else -1], np.int64), name=f"{name}.size",
                          process_set=process_set).tolist()
    members = members_of(process_set, len(sizes))
    if min(sizes) < 0:
        raise _unpicklable("allgather_object", name, [members[k] for k, n in enumerate(sizes) if n < 0],
                           failed) from failed
    data = api.allgather(payload, name=f"{name}.data", process_set=process_set)
    out, start = [], 0
    for k, n in enumerate(sizes):
        out.append(_loads(data[start:start + n], "allgather_object", name, members[k]))
        start += n
    return out


def check_same_keys(keys, call: str, name: str, process_set=None, what: str = "parameters", wrong=None,
                    wrong_error=TypeError) -> None:
    """Raise the same ``TensorMismatchError`` on every rank (of ``process_set``) unless all of them pass the same
    ``keys`` (in any order): one small exchange of the lists, before a call sends one collective per key. The
    error names what only some ranks have and the ranks (else each rank waited for collectives the others never
    send, a hang until the stall shutdown: a model with one layer more, or wider, on one rank). ``wrong``: this
    rank's complaints about its own values (strings; a checkpoint's numpy array where a tensor belongs), sent in
    the same exchange: where any rank has one, ``wrong_error`` on every rank naming each such rank's first."""
    keys = sorted(str(k) for k in keys)
    exchanged = allgather_object(keys if wrong is None else (keys, list(wrong)), name=name, process_set=process_set)
    members = members_of(process_set, len(exchanged))
    if wrong is not None:
        bad = [f"rank {r}: {w[0]}" for r, (_, w) in zip(members, exchanged) if w]
        if bad:
            raise wrong_error(f"{call}: {'; '.join(bad)}")
        exchanged = [k for k, _ in exchanged]
    if all(k == keys for k in exchanged):
        return
    only = only_on_some_ranks(exchanged, members, show=lambda ks: describe(ks, limit=8))
    counts = "; ".join(f"rank {r}: {len(ks)}" for r, ks in zip(members, exchanged))
    raise TensorMismatchError(f"{call}: the ranks have different {what} ({counts} {what}): "
                              f"{only or 'names repeated a different number of times'}; every rank must pass the same "
                              f"{what} (the same model)")


def average_factors(op, gradient_predivide_factor: float = 1.0):
    """(op, prescale, postscale) for Horovod's ``gradient_predivide_factor``.

    With op=Average the average is split: gradients are divided by the factor before the
    sum and by ``size / factor`` after it. Other ops ignore the factor (as in Horovod).
    """
    op = as_reduce_op(op)
    f = float(gradient_predivide_factor)
    if not f > 0 or f == math.inf:  # (NaN and inf got through: the first step named a bucket's prescale_factor)
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor!r} must be a finite number > 0")
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


def check_passes(passes) -> int:
    """``backward_passes_per_step`` (the torch wrapper's, TF1's ``DistributedOptimizer``'s) as an int; a ValueError
    naming it unless it is a whole number >= 1 (1.5 was taken as 1, '2' was a TypeError about '<'; aiacc.keras says
    the same)."""
    if isinstance(passes, bool) or not isinstance(passes, numbers.Integral) or passes < 1:
        raise ValueError(f"backward_passes_per_step={passes!r} must be a whole number >= 1")
    return int(passes)


def check_groups(num_groups, groups, what: str = "DistributedOptimizer", member: Optional[type] = None) -> None:
    """Horovod's checks of a gradient wrapper's ``num_groups`` / ``groups`` (which change nothing in aiacc: the
    core fuses whatever gradients are ready): a count >= 0 (``groups``: >= 1), or a list of lists; with ``member`` (the framework's
    tensor class, which Horovod's torch wrapper checks) of such tensors, none twice. A ValueError naming the
    argument otherwise."""
    kind = f"{member.__module__.split('.')[0]}.{member.__name__}" if member is not None else "tensors"
    for arg, value in (("num_groups", num_groups), ("groups", groups)):
        if value is None or isinstance(value, list):
            continue
        least = 1 if arg == "groups" else 0  # (num_groups=0 is the default; groups=0 Horovod refuses)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
            raise ValueError(f"{what}: {arg}={value!r}; expected a number of groups >= {least}"
                             + (f" or a list of lists of {kind}" if arg == "groups" else ""))
    if isinstance(num_groups, list):
        raise ValueError(f"{what}: num_groups is a number; pass lists of tensors as groups=")
    if isinstance(groups, list) and member is not None:
        seen = set()
        for i, group in enumerate(groups):
            for p in group if isinstance(group, (list, tuple)) else [group]:
                if not isinstance(p, member):
                    raise ValueError(f"{what}: groups[{i}] holds a {type(p).__name__}; groups must be a list of lists "
                                     f"of {kind} (the parameters to reduce together)")
                if id(p) in seen:
                    raise ValueError(f"{what}: a parameter (shape {tuple(p.shape)}) appears twice in groups; a "
                                     "parameter can only appear once in groups")
                seen.add(id(p))
