"""Horovod's elastic state objects (``hvd.elastic.*State``), for a job whose ranks do not change.

What aiacc provides: the in-memory state of Horovod's elastic API — ``commit()`` keeps a copy of the
state, ``restore()`` goes back to the last copy, ``sync()`` makes every rank hold rank 0's state — and
``run(func)``, so that scripts written for ``horovod.*.elastic`` run unchanged. What it does not provide:
elasticity itself. An aiacc job has the ranks ``aiaccrun`` started; no host is added or removed while it
runs, so ``commit()`` never raises ``HostsUpdatedInterrupt``, and ``run`` calls ``func`` once, after
``state.sync()``. A rank that fails ends the job (see the README: errors, never hangs), it is not replaced.

The framework parts (a model's variables) are the adapters' subclasses of :class:`ObjectState`
(``aiacc.tensorflow.elastic.TensorFlowKerasState``, ...); this module is framework-free.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable

from .objects import broadcast_object
from .api import rank

__all__ = ["State", "ObjectState", "run"]


class State:
    """State kept in memory across ranks. ``bcast_object(obj)`` sends rank 0's object to every rank;
    ``get_rank()`` returns this rank."""

    def __init__(self, bcast_object: Callable = broadcast_object, get_rank: Callable = rank):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable]) -> None:
        """Functions to call after a reset (in Horovod: when ranks were added or removed). An aiacc job never
        resets; they are kept for scripts that register them."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Keep the current state in memory (``restore()`` returns to it)."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Horovod raises ``HostsUpdatedInterrupt`` here when hosts joined or left: an aiacc job keeps its
        ranks, so there is never anything to report."""

    def save(self) -> None:
        raise NotImplementedError()

    def restore(self) -> None:
        raise NotImplementedError()

    def sync(self) -> None:
        raise NotImplementedError()

    def reset(self) -> None:
        """Called before synchronising after a reset (never, in an aiacc job)."""


class ObjectState(State):
    """State made of picklable Python objects, given as keyword arguments and exposed as attributes
    (``state.epoch``, ``state.batch``): ``save`` copies the attributes, ``restore`` sets them back,
    ``sync`` sets rank 0's values on every rank."""

    def __init__(self, bcast_object: Callable = broadcast_object, get_rank: Callable = rank, **kwargs):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)


def run(func: Callable) -> Callable:
    """Horovod's ``@hvd.elastic.run``: ``func(state, ...)`` starts from rank 0's state (``state.sync()``).
    The job's ranks never change, so ``func`` runs once and its errors are not retried."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        state.sync()
        return func(state, *args, **kwargs)

    return wrapper
