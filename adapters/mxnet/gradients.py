"""Gradients to the engine the moment MXNet has computed them, through MXNet's engine callbacks.

MXNet computes asynchronously: ``loss.backward()`` returns once the backward
pass is *queued*, and MXNet's worker thread produces the gradients later, a
bulk segment of operators at a time (last layers first). A tiny operator
pushed into MXNet's dependency engine (``MXEnginePushSyncND``) that *reads*
some gradients runs as soon as every write of them is done, and calls back
into Python right there. So communication starts while MXNet is still
computing the rest of backward.

:class:`ParameterGradients` (``DistributedTrainer``) keeps the gradients of a
fixed list of Gluon parameters in the core's gradient buckets
(:class:`aiacc.buckets.GradientBuckets`): each ``Parameter``'s gradient
NDArray *is* a view of its bucket's memory (DDP's ``gradient_as_bucket_view``),
so MXNet's backward writes straight into the buckets, the engine reduces each
bucket in place, and the optimizer reads the result where it lies: no
gradient is copied. One callback per bucket depends on all of the bucket's
gradients; when MXNet has finished them it marks them ready (a counter each)
and the bucket goes to the engine as ONE request::

    MXNet worker        | segment: grads L..k | segment: grads k-1..1 |
    MXNet callback                 ^ bucket 0 ready          ^ bucket 1 ready
    aiacc engine                    [ reduce bucket 0 ]       [ reduce bucket 1 ]
    step() thread       waits .......................................... | update

The first step is different: the buckets are not settled yet. One callback
per gradient hands its gradient (a numpy view of MXNet's memory) to the
buckets, which learn the order the gradients arrive in; once every gradient
is in, the buckets are settled (a collective that also checks every rank has
the same parameters), the gradients are copied into them (one copy each,
once), reduced, and every ``Parameter``'s gradient is pointed at its bucket
(``autograd.mark_variables``, what ``Parameter._init_grad`` itself does).
A gradient that is later replaced by MXNet (``Parameter.cast``, a change of
``grad_req``, re-initialisation) is found by an identity check in the next
step, copied into its bucket by its callback (one copy, that step only) and
pointed back at the bucket; a change of shape, dtype or of the set of
parameters that take gradients settles new buckets.

The callbacks are pushed with MXNet's ``kCPUPrioritized`` property, so they run
on MXNet's small pool of priority threads and never queue behind the next
compute segment on the (single) worker thread. Waiting with ``wait_to_read()``
instead puts MXNet's wait operator in that worker's queue: measured here with
2 ranks on 2 busy cores, it ran only after the next segment, and every
gradient of the cnn benchmark model appeared at the end of backward (with the
callbacks: the dense layers' 30-160 ms before the convolutions'). Those
threads may run callbacks concurrently, and ``GradientBuckets.ready`` is not
thread-safe: one lock per :class:`ParameterGradients` serialises the calls
(one acquisition per bucket per step).

Memory order: the engine writes a bucket only after MXNet's last write of its
gradients (the callback's dependency); MXNet reads them again only in the
optimizer, which runs after ``step()`` has waited for every bucket; the next
backward's writes are queued behind the optimizer's reads by MXNet itself.

:func:`reduce_gradients` (the Module API's ``DistributedOptimizer``, whose
optimizer is handed gradients a few at a time and must apply each update
before it returns) submits each gradient on its own, in place, from a
callback per gradient.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import logging
import threading
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

import mxnet as mx
from mxnet.base import NDArrayHandle, _LIB, check_call
from mxnet.ndarray.ndarray import _c_dlpack_deleter, _c_str_dltensor

import aiacc
from aiacc import Collective, devices
from aiacc.buckets import GradientBuckets, ParamSpec

from .tensors import check_ndarray, writable_from_capsule

logger = logging.getLogger(__name__)

__all__ = ["ParameterGradients", "reduce_gradients"]

_SyncFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)


class _Context(ctypes.Structure):  # mxnet::Context
    _fields_ = [("dev_type", ctypes.c_int), ("dev_id", ctypes.c_int32)]


_CPU = _Context(1, 0)  # Context::kCPU
_CPU_PRIORITIZED = ctypes.c_int(3)  # FnProperty::kCPUPrioritized (include/mxnet/engine.h)
_ASK_MXNET_AFTER = 0.05  # seconds
_pending = {}  # key -> the function to call once its arrays are final
_keys = itertools.count(1)


def _on_ready(_run_context, key) -> None:
    """Runs on an MXNet engine thread once every array of callback ``key`` is final."""
    fn = _pending.pop(key, None)
    if fn is not None:
        fn()


_ON_READY = _SyncFn(_on_ready)  # kept alive for the life of the process


def _handles(arrays: Sequence["mx.nd.NDArray"]):
    return (NDArrayHandle * len(arrays))(*[a.handle for a in arrays])


def _push(fn: Callable[[], None], handles, count: int) -> None:
    """Have MXNet call ``fn()`` on a priority thread once every write of the ``count`` arrays of
    ``handles`` (from :func:`_handles`) pushed so far is done. MXNet skips it if one failed."""
    key = next(_keys)
    _pending[key] = fn
    try:
        check_call(_LIB.MXEnginePushSyncND(_ON_READY, ctypes.c_void_p(key), None, ctypes.byref(_CPU),
                                           handles, count, None, 0, ctypes.byref(_CPU_PRIORITIZED), 0,
                                           b"aiacc_gradient_ready"))
    except BaseException:
        _pending.pop(key, None)
        raise


def _writable_view_now(tensor, name: str) -> np.ndarray:
    """MXNet's DLPack export without ``to_dlpack_for_read``'s wait: the caller orders the accesses."""
    check_ndarray(tensor, name, "gradient")
    dlpack = ctypes.c_void_p()
    check_call(_LIB.MXNDArrayToDLPack(tensor.handle, ctypes.byref(dlpack)))
    capsule = ctypes.pythonapi.PyCapsule_New(dlpack, _c_str_dltensor, _c_dlpack_deleter)
    return writable_from_capsule(capsule)


class _Call:
    """One pushed callback of a step: ``done`` once it ran (or was abandoned), ``error`` if it failed."""

    __slots__ = ("arrays", "done", "error")

    def __init__(self, arrays):
        self.arrays = arrays  # the NDArrays it waits for (asked directly when it is late)
        self.done = threading.Event()
        self.error: Optional[BaseException] = None


def _wait_calls(calls: Sequence[_Call]) -> None:
    """Wait until every callback has run; raise the first error (MXNet's, for a failed write)."""
    for call in calls:
        # MXNet skips the callback of a gradient whose computation failed; asking MXNet
        # (wait_to_read raises that error) only when a callback is late keeps the common
        # path free of MXNet's wait operators.
        while not call.done.wait(_ASK_MXNET_AFTER):
            for array in call.arrays:
                array.wait_to_read()
        if call.error is not None:
            raise call.error


# ---- DistributedTrainer: gradients that live in the core's buckets --------------------------------
def _rebind_static(params) -> None:
    """Blocks hybridized with ``static_alloc=True, static_shape=True`` bind their parameters' gradient arrays
    when their CachedOp runs its first backward, and keep writing those even after ``mark_variables`` points a
    gradient elsewhere (its bucket): the bucket kept a stale gradient, ``zero_grad`` and edits of ``p.grad()``
    (clipping) missed what backward wrote, and ``grad_req='add'`` summed without end. The CachedOps of such
    blocks that use any of ``params`` are cleared (``_clear_cached_op``, what ``hybridize`` and ``cast`` do), so
    the next forward builds them again, bound to the gradients' current arrays, the buckets. Found by a scan
    of the live objects, once per change of gradient arrays (the first step; a gradient MXNet replaced); a
    static block built later binds the buckets already."""
    wanted = {id(p) for p in params}
    for obj in gc.get_objects():
        # (type(), not isinstance: that reads ``__class__``, which some objects answer with a warning, e.g.
        # torch.distributed.reduce_op's FutureWarning in a script that also imports torch)
        if issubclass(type(obj), mx.gluon.HybridBlock) and getattr(obj, "_cached_op", None) is not None:
            flags = dict(getattr(obj, "_flags", ()))
            if (flags.get("static_alloc") or flags.get("static_shape")) and any(
                    not is_arg and id(p) in wanted for is_arg, p in getattr(obj, "_cached_op_args", ())):
                obj._clear_cached_op()


def _point_grad_at(param, grad) -> None:
    """Make ``grad`` the gradient of ``param``: what ``Parameter._init_grad`` does, keeping the
    'fresh gradient' mark that ``Trainer.step`` checks (it belongs to the autograd entry
    ``mark_variables`` replaces)."""
    data = param._data
    fresh = [d._fresh_grad for d in data]
    param._grad = [grad]
    mx.autograd.mark_variables(data, param._grad, param.grad_req)
    for d, f in zip(data, fresh):
        if f:
            d._fresh_grad = True


class ParameterGradients:
    """The gradients of ``params`` (Gluon Parameters, one context each) in the core's buckets.

    ``labels``: their names across ranks (``params`` in forward order: the core's buckets give those
    nearer the input the higher priority); ``process_set``: the ranks that average them (default: every
    rank). Built at the
    first step, when every shape is known; ``reduce()`` per step, ``matches(params)`` tells whether
    the buckets still fit.
    """

    def __init__(self, params: Sequence, labels: Sequence[str], *, op, prescale: float,
                 postscale: float, compression=None, process_set=None):
        specs = []
        for p, label in zip(params, labels):
            grads = p.list_grad()  # MXNet's own error for a parameter not initialised yet
            if len(grads) != 1:
                raise ValueError(f"parameter {p.name!r} is on {len(grads)} contexts; aiacc.mxnet trains "
                                 "with one context per process (launch one rank per device)")
            check_ndarray(grads[0], label, "gradient")
            specs.append(ParamSpec(label, tuple(grads[0].shape), np.dtype(grads[0].dtype), devices.CPU))
        self.process_set = process_set
        self.engine = aiacc.engine_for(process_set)  # the engine of the set: its buckets live there
        self.params = list(params)
        self.labels = list(labels)
        self.specs = specs
        # one flag per gradient, which travels in a bucket: this rank computed it this step (reduce())
        # (and presence, for ``retire``: all present, an element per gradient and one more, in each bucket)
        self._options = dict(op=op, prescale=prescale, postscale=postscale, compression=compression,
                             cap=self.engine.config.bucket_cap, flags=len(specs), presence=True, regroup_hint=(
                                 " (set grad_req on every rank alike, between the same steps)"))
        self.buckets = GradientBuckets(self.engine, specs, **self._options)
        self.grads: Optional[list] = None  # each parameter's NDArray over its bucket memory, once settled
        self._groups: Optional[List[Tuple[List[int], object, int]]] = None  # per bucket: members, handles, count
        self._replaced = False  # a gradient was replaced by MXNet and copied in this step
        self._lock = threading.Lock()  # GradientBuckets.ready is called from MXNet's threads
        self._generation = 0  # callbacks of an abandoned step find it changed and do nothing

    def matches(self, params: Sequence) -> bool:
        """True while these buckets still fit ``params`` (the same parameters, whose gradients
        are the buckets' or of the registered shape and dtype) and the engine they were built on
        runs. Constant work per parameter while the gradients are the buckets'."""
        if aiacc.engine_for(self.process_set) is not self.engine or len(params) != len(self.params):
            return False
        grads = self.grads or [None] * len(params)
        for p, q, spec, ours in zip(params, self.params, self.specs, grads):
            if p is not q:
                return False
            current = p._grad
            if current is None or len(current) != 1:
                return False
            if current[0] is not ours and (current[0].shape != spec.shape or current[0].dtype != spec.dtype):
                return False
        return True

    def retire(self, labels: Sequence[str]) -> None:
        """This rank's parameters that take gradients changed to ``labels`` (a layer frozen or unfrozen): the other
        ranks hear of it (``GradientBuckets.retire``); a TensorMismatchError on every rank unless all of them made
        the same change (a rank that froze a layer alone waited for ever, as the others' buckets never came).
        Nothing before the buckets are settled (the first step's setup checks the lists) or on another engine."""
        if self.buckets.established and aiacc.engine_for(self.process_set) is self.engine:
            self.buckets.retire(list(labels))

    # ---- per step ------------------------------------------------------------------------------
    def reduce(self, fresh: Sequence[bool]) -> np.ndarray:
        """Average every gradient across ranks; returns once the optimizer can read them. ``fresh``: whether
        this rank computed each gradient this step; returns whether any rank did (bools), told in a bucket."""
        self.buckets.set_flags(fresh)
        calls = self._push_each() if self.grads is None else self._push_buckets()
        try:
            _wait_calls(calls)
        except BaseException:
            self._abandon()
            raise
        try:
            self.buckets.wait()  # in the first step this settles the buckets (a collective)
            return self.buckets.flags_set()
        finally:
            self._end_step()

    def _push_each(self) -> List[_Call]:
        """The first step: one callback per gradient, handing MXNet's memory to the buckets."""
        generation = self._generation
        calls = []
        for i in reversed(range(len(self.params))):  # backward order: the order MXNet finishes them
            grad = self.params[i]._grad[0]
            view = _writable_view_now(grad, self.labels[i])
            call = _Call((grad,))
            _push(self._ready_fn(call, generation, (i,), (view,)), _handles((grad,)), 1)
            calls.append(call)
        return calls

    def _push_buckets(self) -> List[_Call]:
        """One callback per bucket; a gradient no longer in its bucket (replaced by MXNet) is copied in by it."""
        generation = self._generation
        grads, params = self.grads, self.params
        calls = []
        for members, handles, count in self._groups:
            current = [params[i]._grad[0] for i in members]
            arrays = None
            for c, i in zip(current, members):
                if c is not grads[i]:
                    arrays = tuple(None if c is grads[i] else _writable_view_now(c, self.labels[i])
                                   for c, i in zip(current, members))
                    # after the writes of the bucket memory too: a static CachedOp still writes the arrays it
                    # bound (the buckets) until _rebind_static, which raced the copy-in (ranks diverged)
                    waits = list(current) + [grads[i] for c, i in zip(current, members) if c is not grads[i]]
                    handles, count = _handles(waits), len(waits)
                    self._replaced = True
                    break
            call = _Call(current)
            _push(self._ready_fn(call, generation, members, arrays), handles, count)
            calls.append(call)
        return calls

    def _ready_fn(self, call: _Call, generation: int, members, arrays):
        """What runs on MXNet's thread: mark ``members`` ready (copying in ``arrays`` where given)."""
        lock, buckets = self._lock, self.buckets

        def fire() -> None:
            with lock:
                if generation == self._generation:
                    try:
                        ready = buckets.ready
                        if arrays is None:
                            for i in members:
                                ready(i)
                        else:
                            for i, array in zip(members, arrays):
                                ready(i, array)
                    except BaseException as exc:  # noqa: BLE001 - raised in the training thread
                        call.error = exc
            call.done.set()

        return fire

    def _abandon(self) -> None:
        """After an error (a failed backward): no late callback may touch the buckets, and every
        bucket is still sent once, with what this rank has, so that no other rank waits for it."""
        with self._lock:
            self._generation += 1
        for p in self.params:  # MXNet finishes (or fails) its writes before the buckets are sent
            try:
                p._grad[0].wait_to_read()
            except Exception:  # noqa: BLE001 - the error being raised is the first one
                pass
        try:
            self.buckets.wait()
        except Exception:  # noqa: BLE001 - the error being raised is the first one
            pass
        finally:
            self._end_step()

    def _end_step(self) -> None:
        """After the buckets were waited for, whatever happened: the next step starts clean."""
        buckets = self.buckets
        if not buckets.established:  # the first step failed before the buckets were settled
            self.buckets = GradientBuckets(self.engine, self.specs, **self._options)
            return
        buckets.reset()
        if self.grads is None:
            self._settle()
        elif self._replaced:  # copied into the buckets this step: point them back
            self._replaced = False
            for grad, p in zip(self.grads, self.params):
                if p._grad[0] is not grad:
                    _point_grad_at(p, grad)
            _rebind_static(self.params)

    def _settle(self) -> None:
        """After the first step: every gradient becomes an NDArray over its bucket memory (which
        holds the averaged gradient already)."""
        buckets = self.buckets
        grads = []
        for i, p in enumerate(self.params):
            view = buckets.view(i)
            if view.size:
                grad = mx.nd.from_dlpack(view.__dlpack__())
                if isinstance(p._grad[0], mx.np.ndarray):  # numpy semantics (npx.set_np()): keep gluon's type
                    grad = grad.as_np_ndarray()  # the same memory
                _point_grad_at(p, grad)
            else:  # nothing to reduce: MXNet keeps its own (empty) gradient
                grad = p._grad[0]
            grads.append(grad)
        self.grads = grads
        _rebind_static(self.params)
        index = {label: i for i, label in enumerate(self.labels)}
        self._groups = []
        for labels in buckets.describe():
            members = [index[label] for label in labels]
            arrays = [grads[i] for i in members]
            self._groups.append((members, _handles(arrays), len(arrays)))


# ---- the Module API: one request per gradient ------------------------------------------------------
def reduce_gradients(items: Sequence[Tuple[str, "mx.nd.NDArray", float]], *, op, prescale: float,
                     postscale: float, compression=None, process_set=None) -> None:
    """Average ``items`` = [(name, gradient NDArray, priority), ...] across the ranks (of
    ``process_set``), in place.

    Each gradient goes to the engine as its own request as soon as MXNet has computed it;
    returns when all are reduced.
    """
    kwargs = dict(op=op, prescale=prescale, postscale=postscale, compression=compression, process_set=process_set)
    lock = threading.Lock()
    state = {"cancelled": False}
    calls: List[_Call] = []
    handles: list = []

    def submit_fn(call: _Call, name: str, view: np.ndarray, priority: float):
        def fire() -> None:
            with lock:
                if not state["cancelled"]:
                    try:
                        handles.append(aiacc.submit(Collective.ALLREDUCE, view, name=name, outputs=[view],
                                                    priority=priority, **kwargs))
                    except BaseException as exc:  # noqa: BLE001 - raised in the training thread
                        call.error = exc
            call.done.set()
        return fire

    try:
        for name, grad, priority in items:
            call = _Call((grad,))
            _push(submit_fn(call, name, _writable_view_now(grad, name), priority), _handles((grad,)), 1)
            calls.append(call)
        _wait_calls(calls)
    except BaseException:
        with lock:  # submit nothing more; let what was submitted finish before returning
            state["cancelled"] = True
        try:
            aiacc.synchronize_all(list(handles))
        except Exception:  # noqa: BLE001 - the first error is the one being raised
            pass
        raise
    aiacc.synchronize_all(handles)
