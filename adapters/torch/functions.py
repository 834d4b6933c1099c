"""Start-of-training helpers: make every rank begin from the root's model and optimizer state.

With aiacc disabled (``AIACC_ENABLE`` unset or 0) both broadcasts do nothing: a
job of one rank already agrees with itself.
"""

from __future__ import annotations

import logging
from typing import Any, List

import torch

import aiacc
from aiacc.tensors import check_dtype

from .arrays import to_numpy
from .mpi_ops import allreduce, broadcast_async_

logger = logging.getLogger(__name__)

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]


def broadcast_parameters(params, root_rank: int = 0, prefix: str = "Parameter.", process_set=None) -> None:
    """Overwrite tensors on every rank with ``root_rank``'s, in place.

    ``params``: a ``state_dict()`` (parameters and buffers) or ``named_parameters()`` (a list or
    generator of ``(name, tensor)``; plain tensors are accepted and matched by position). A
    tensor whose shape or dtype differs across ranks raises ``TensorMismatchError`` on every
    rank, naming it (``prefix + name``) and the ranks; so do names (or, for plain tensors, a number of them)
    that differ across ranks (a model with a layer more on one rank). Switched off, a job of one rank: the
    arguments are checked and nothing changes.
    """
    root_rank = aiacc.check_root(root_rank, "broadcast_parameters", process_set)
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, torch.Tensor):
        raise ValueError("broadcast_parameters expects a state_dict or named_parameters(), not a single tensor")
    elif isinstance(params, torch.nn.Module):  # (iterating a Module raises a TypeError that says nothing of this)
        raise ValueError(f"broadcast_parameters takes the model's state_dict() (parameters and buffers) or "
                         f"named_parameters(), not the {type(params).__name__} module itself: "
                         "hvd.broadcast_parameters(model.state_dict(), root_rank=0)")
    else:
        try:
            items = [p if isinstance(p, tuple) else (None, p) for p in params]
        except TypeError:
            raise ValueError(f"broadcast_parameters: params of type {type(params).__name__} is neither a "
                             "state_dict nor an iterable of (name, tensor)") from None
    labels = [None if name is None else prefix + str(name) for name, _ in items]
    # every tensor is checked before the first is sent: an error leaves nothing in flight (before, a buffer of a
    # dtype aiacc does not carry raised with the tensors before it sent, and a retry met DuplicateNameError on
    # their names)
    for (name, tensor), label in zip(items, labels):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"broadcast_parameters: {name!r} is a {type(tensor).__name__}, not a tensor")
        check_dtype(to_numpy(tensor, label).dtype, label or "(unnamed)")
    if aiacc.size() > 1:  # the same names on every rank, else each waits for broadcasts the others never send
        aiacc.check_same_keys([label or f"#{k}" for k, label in enumerate(labels)], "broadcast_parameters",
                              f"{prefix}broadcast_parameters.keys", process_set, "tensors")
    handles = [broadcast_async_(tensor, root_rank, name=label, process_set=process_set)
               for (_, tensor), label in zip(items, labels)]
    for h in handles:
        h.wait()


class _Slot:
    """Where a tensor sat in an optimizer's state_dict (shape and dtype travel, the data does not)."""

    __slots__ = ("index", "shape", "dtype")

    def __init__(self, index: int, shape, dtype):
        self.index, self.shape, self.dtype = index, tuple(shape), dtype

    def __reduce__(self):
        return (_Slot, (self.index, self.shape, self.dtype))


def _strip(obj, found: List[torch.Tensor]):
    """``obj`` with every tensor replaced by a _Slot; the tensors are appended to ``found``."""
    if isinstance(obj, torch.Tensor):
        found.append(obj)
        return _Slot(len(found) - 1, obj.shape, obj.dtype)
    if isinstance(obj, dict):
        return type(obj)((k, _strip(v, found)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_strip(v, found) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_strip(v, found) for v in obj)
    return obj


def _fill(obj, tensors: List[torch.Tensor]):
    if isinstance(obj, _Slot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return type(obj)((k, _fill(v, tensors)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_fill(v, tensors) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


def broadcast_optimizer_state(optimizer, root_rank: int = 0, model=None, prefix: str = "Parameter.") -> None:
    """Make every rank's optimizer state (moments, step counts, learning rates, ...) equal to the root's.

    Works for any ``torch.optim.Optimizer`` (or ``DistributedOptimizer``), also when only the root
    has state (for example after loading a checkpoint there): the structure of the root's
    ``state_dict`` travels as one small object, then every tensor in it is broadcast without
    pickling, straight into tensors the other ranks load with ``load_state_dict``. Unlike Horovod,
    no dummy ``step()`` is taken to create state, so a fresh optimizer stays fresh. ``model`` is Horovod's
    argument (it names the sparse embeddings for that dummy step): accepted, and a torch module if given.
    """
    if model is not None and not isinstance(model, torch.nn.Module):
        raise ValueError(f"broadcast_optimizer_state: model= expects a torch.nn.Module, not {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"broadcast_optimizer_state expects a torch.optim.Optimizer, not {type(optimizer).__name__}")
    root_rank = aiacc.check_root(root_rank, "broadcast_optimizer_state")
    me = aiacc.rank()
    state = optimizer.state_dict()
    # Every rank compares the optimizers' classes and shapes before any tensor moves, so a mismatch is the
    # same clear error on every rank instead of a hang or a late failure (another class: the root's settings
    # loaded into it, a KeyError of torch's at the next step()).
    layouts = aiacc.allgather_object((type(optimizer).__name__, [len(g["params"]) for g in state["param_groups"]]),
                                     name=f"{prefix}optimizer.layout")
    if any(layout != layouts[root_rank] for layout in layouts):
        detail = "; ".join(f"rank {r}: {kind} {counts}" for r, (kind, counts) in enumerate(layouts))
        raise ValueError("broadcast_optimizer_state: the optimizers differ across ranks (class and parameters per "
                         f"parameter group: {detail}); every rank must build the same optimizer")
    tensors: List[torch.Tensor] = []
    skeleton = _strip(state, tensors)
    root_skeleton = aiacc.broadcast_object(skeleton if me == root_rank else None, root_rank,
                                           name=f"{prefix}optimizer.structure")
    if me != root_rank:
        slots: List[_Slot] = []
        _collect_slots(root_skeleton, slots)
        tensors = [torch.empty(s.shape, dtype=s.dtype) for s in sorted(slots, key=lambda s: s.index)]
    handles = [broadcast_async_(t, root_rank, name=f"{prefix}optimizer.state.{i}") for i, t in enumerate(tensors)]
    for h in handles:
        h.wait()
    if me != root_rank:
        optimizer.load_state_dict(_fill(root_skeleton, tensors))


def _collect_slots(obj, out: List[_Slot]) -> None:
    if isinstance(obj, _Slot):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect_slots(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect_slots(v, out)


def broadcast_object(obj: Any, root_rank: int = 0, name=None, process_set=None) -> Any:
    """``root_rank``'s ``obj`` (anything picklable) on every rank (of ``process_set``)."""
    return aiacc.broadcast_object(obj, root_rank, name=name, process_set=process_set)


def allgather_object(obj: Any, name=None, process_set=None) -> list:
    """Every rank's ``obj`` in a list, in rank order (of ``process_set``)."""
    return aiacc.allgather_object(obj, name=name, process_set=process_set)


def averaged_loss(loss, process_set):
    """``loss`` (a closure's: a scalar tensor or a number, or None) averaged across the ranks, of its type."""
    if loss is None:
        return None
    if isinstance(loss, torch.Tensor):
        return allreduce(loss.detach(), name="DistributedOptimizer.closure_loss", process_set=process_set)
    return float(allreduce(torch.tensor(float(loss), dtype=torch.float64), name="DistributedOptimizer.closure_loss",
                           process_set=process_set))
