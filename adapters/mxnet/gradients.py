"""Gradients to the engine the moment MXNet has computed them, through MXNet's engine callbacks.

MXNet computes asynchronously: ``loss.backward()`` returns once the backward
pass is *queued*, and MXNet's worker thread produces the gradients later, a
bulk segment of operators at a time (last layers first). For every gradient,
:func:`reduce_gradients` pushes a tiny operator into MXNet's dependency engine
(``MXEnginePushSyncND``) that *reads* the gradient: MXNet runs it as soon as
every write of that gradient is done, and it submits the gradient to aiacc's
engine right there. So communication starts while MXNet is still computing
the rest of backward::

    MXNet worker        | segment: grads L..k | segment: grads k-1..1 |
    MXNet callback                           ^ submit L..k            ^ submit k-1..1
    aiacc engine                              [ reduce L..k  ]         [ reduce k-1..1 ]
    step() thread       waits ............................................... | update

The callbacks are pushed with MXNet's ``kCPUPrioritized`` property, so they run
on MXNet's small pool of priority threads and never queue behind the next
compute segment on the (single) worker thread. Waiting with ``wait_to_read()``
instead puts MXNet's wait operator in that worker's queue: measured here with
2 ranks on 2 busy cores, it ran only after the next segment, and every
gradient of the cnn benchmark model appeared at the end of backward (with the
callbacks: the dense layers' 30-160 ms before the convolutions').

Memory: the numpy views of the gradients are made before the callbacks are
pushed, from MXNet's DLPack export without its wait (the engine dependency is
the wait); the engine reduces in place into MXNet's gradient memory. Nothing
else touches a gradient between its last backward write and the optimizer,
which runs only after :func:`reduce_gradients` has returned.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
from typing import List, Optional, Sequence, Tuple

import numpy as np

import mxnet as mx
from mxnet.base import NDArrayHandle, _LIB, check_call
from mxnet.ndarray.ndarray import _c_dlpack_deleter, _c_str_dltensor

import aiacc
from aiacc import Collective

from .tensors import check_ndarray, writable_from_capsule

logger = logging.getLogger(__name__)

__all__ = ["reduce_gradients"]

_SyncFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)


class _Context(ctypes.Structure):  # mxnet::Context
    _fields_ = [("dev_type", ctypes.c_int), ("dev_id", ctypes.c_int32)]


_CPU = _Context(1, 0)  # Context::kCPU
_CPU_PRIORITIZED = ctypes.c_int(3)  # FnProperty::kCPUPrioritized (include/mxnet/engine.h)
_ASK_MXNET_AFTER = 0.05  # seconds
_slots = {}
_keys = itertools.count(1)
_lock = threading.Lock()


def _on_ready(_run_context, key) -> None:
    """Runs on an MXNet engine thread once the gradient of slot ``key`` is final."""
    slot = _slots.pop(key, None)
    if slot is not None:
        slot.fire()


_ON_READY = _SyncFn(_on_ready)  # kept alive for the life of the process


def _writable_view_now(tensor, name: str) -> np.ndarray:
    """MXNet's DLPack export without ``to_dlpack_for_read``'s wait: the caller orders the accesses."""
    check_ndarray(tensor, name, "gradient")
    dlpack = ctypes.c_void_p()
    check_call(_LIB.MXNDArrayToDLPack(tensor.handle, ctypes.byref(dlpack)))
    capsule = ctypes.pythonapi.PyCapsule_New(dlpack, _c_str_dltensor, _c_dlpack_deleter)
    return writable_from_capsule(capsule)


class _Slot:
    """One gradient: submitted by MXNet's callback, waited for by the training thread."""

    __slots__ = ("name", "grad", "view", "kwargs", "ready", "handle", "error", "cancelled")

    def __init__(self, name, grad, view, kwargs):
        self.name, self.grad, self.view, self.kwargs = name, grad, view, kwargs
        self.ready = threading.Event()
        self.handle = None
        self.error: Optional[BaseException] = None
        self.cancelled = False

    def fire(self) -> None:
        with _lock:
            if self.cancelled:
                self.ready.set()
                return
            try:
                self.handle = aiacc.submit(Collective.ALLREDUCE, self.view, name=self.name,
                                           outputs=[self.view], **self.kwargs)
            except BaseException as exc:  # noqa: BLE001 - raised in the training thread
                self.error = exc
            self.ready.set()


def _push_callback(slot: _Slot) -> None:
    key = next(_keys)
    _slots[key] = slot
    handles = (NDArrayHandle * 1)(slot.grad.handle)
    try:
        check_call(_LIB.MXEnginePushSyncND(_ON_READY, ctypes.c_void_p(key), None, ctypes.byref(_CPU),
                                           handles, 1, None, 0, ctypes.byref(_CPU_PRIORITIZED), 0,
                                           b"aiacc_gradient_ready"))
    except BaseException:
        _slots.pop(key, None)
        raise


def reduce_gradients(items: Sequence[Tuple[str, "mx.nd.NDArray", float]], *, op, prescale: float,
                     postscale: float, compression=None) -> None:
    """Average ``items`` = [(name, gradient NDArray, priority), ...] across ranks, in place.

    Each gradient goes to the engine as soon as MXNet has computed it; returns when all are
    reduced. Pass them in the order MXNet finishes them (backward order) for the best overlap.
    """
    kwargs = dict(op=op, prescale=prescale, postscale=postscale, compression=compression)
    slots: List[_Slot] = []
    try:
        for name, grad, priority in items:
            slot = _Slot(name, grad, _writable_view_now(grad, name), dict(kwargs, priority=priority))
            _push_callback(slot)
            slots.append(slot)
        for slot in slots:
            # MXNet skips the callback of a gradient whose computation failed; asking MXNet
            # (wait_to_read raises that error) only when a callback is late keeps the common
            # path free of MXNet's wait operators.
            while not slot.ready.wait(_ASK_MXNET_AFTER):
                slot.grad.wait_to_read()
            if slot.error is not None:
                raise slot.error
    except BaseException:
        _abandon(slots)
        raise
    _wait_handles(slots)


def _abandon(slots: List[_Slot]) -> None:
    """After an error: submit nothing more, and let what was submitted finish before returning."""
    with _lock:
        for slot in slots:
            if not slot.ready.is_set():
                slot.cancelled = True
    try:
        _wait_handles(slots)
    except Exception:  # noqa: BLE001 - the first error is the one being raised
        pass


def _wait_handles(slots: List[_Slot]) -> None:
    aiacc.synchronize_all([slot.handle for slot in slots if slot.handle is not None])
