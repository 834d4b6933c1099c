"""Requests: one submitted operation, validated and described for the negotiation.

A :class:`Request` is also the :class:`Handle` its caller waits on. The
:class:`RequestFactory` turns the arguments of ``submit()`` into a request: it
checks the arrays and the arguments (an error names the tensor and the rank,
at once, on the calling thread) and builds the signature (:class:`Meta`)
every rank must agree on. Signatures of single-tensor allreduces are cached,
so a training step's thousandth submit of the same shape costs a dict lookup.
"""

from __future__ import annotations

import collections
import logging
import math
import operator
import threading
import time
from typing import Callable, Optional, Tuple

import numpy as np

from . import devices
from .adasum import check_ranks
from .compression import Compression, Compressor, as_compressor
from .exceptions import InvalidArgumentError
from .negotiation import Meta
from .ops import BITWISE, Collective, ReduceOp, as_reduce_op
from .tensors import check_array, dtype_name, maybe_output, supported_dtypes

__all__ = ["Handle", "Request", "RequestFactory", "Waker", "finish_allreduces", "check_root_rank", "check_rows",
           "check_name", "listed_splits"]

_FREE_FIRST_DIM = (Collective.ALLGATHER, Collective.ALLTOALL)
# ops that are not defined for complex tensors (the bitwise ones name the dtypes they take)
_NOT_COMPLEX = frozenset((ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)) | BITWISE
_ALLREDUCE = Collective.ALLREDUCE
_NDARRAY = np.ndarray
_NONE = Compression.none
_SUPPORTED = frozenset(supported_dtypes())
_now = time.perf_counter
_callbacks_lock = threading.Lock()
_new = object.__new__
logger = logging.getLogger(__name__)


class Handle:
    """An operation in flight. ``wait()`` returns its result or raises its error.

    ``_state``: 0 running, 1 result set and completion callbacks running, 2 finished. A callback
    that raises makes the handle fail with that exception (whoever waits gets it), and a callback
    may itself ``wait()`` for the handle it was given. A thread that blocks waits on its waker's
    ``done`` condition, which completions notify while anyone waits: no lock per handle (a training
    step makes hundreds of handles, and most are waited for by the thread that runs the cycles).
    """

    __slots__ = ("name", "_state", "_result", "_error", "_callbacks", "_wake", "_cb_thread")

    def __init__(self, name: str, wake: Optional["Waker"] = None):
        self.name = name
        self._wake = wake
        self._state = 0
        self._error: Optional[BaseException] = None
        self._callbacks: Optional[list] = None

    def done(self) -> bool:
        """True once the result (or error) is available; never blocks."""
        return self._state == 2

    def wait(self, timeout: Optional[float] = None, deadline: Optional[float] = None):
        """Block until done; return the result or raise the operation's error. ``timeout`` (seconds from now) or
        ``deadline`` (a time of ``_now()``, ``time.perf_counter``: a caller that keeps one per operation passes it
        as it is, with no arithmetic per wait): TimeoutError once it has passed."""
        if self._state != 2 and not (self._state == 1 and getattr(self, "_cb_thread", None) == threading.get_ident()):
            waker = self._wake
            if waker is not None and waker.cycle_thread == threading.get_ident():
                raise RuntimeError(
                    f"waiting for tensor {self.name!r} in a completion callback (add_done_callback): callbacks run "
                    "inside the engine's cycle (on its thread, or on a thread that waits and runs the cycles), which "
                    "would wait for itself; start the operation there and wait for it outside the callback, or wait "
                    "in a thread of your own")
            # the engine's helper runs the cycles on this thread until the handle is done (False on the
            # engine's own thread, or once the engine has stopped): then there is nothing left to wait for.
            # With a timeout it runs them until the deadline (checked between cycles), then waits on ``done``
            # for what is left of it (nothing: TimeoutError)
            if deadline is None and timeout is not None:
                deadline = _now() + timeout
            if waker is None or waker.helper is None or not waker.helper(self, deadline):
                if waker is not None:
                    waker.begin()  # someone waits: the engine cycles now instead of pausing or gathering
                try:
                    self._block(_NO_WAKER if waker is None else waker.done, timeout, deadline)
                finally:
                    if waker is not None:
                        waker.end()
        if self._error is not None:
            raise self._error
        return self._result

    def _block(self, done: threading.Condition, timeout: Optional[float], deadline: Optional[float] = None) -> None:
        """Sleep on ``done`` until finished, or until ``deadline`` (``_now()`` + ``timeout``): TimeoutError. Completion
        sets ``_state`` before it notifies, and notifies holding ``done``: a check made holding it cannot miss the
        notification."""
        if deadline is None and timeout is not None:
            deadline = _now() + timeout
        with done:
            while self._state != 2:
                if deadline is None:
                    done.wait()
                    continue
                left = deadline - _now()
                if left <= 0:
                    raise TimeoutError(f"operation on tensor {self.name!r} did not finish "
                                       f"{'by its deadline' if timeout is None else f'within {timeout} s'}")
                done.wait(left)

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        """Call ``fn(handle)`` when done (at once if done already; else from the engine thread). An
        exception ``fn`` raises from the engine thread becomes the handle's error."""
        with _callbacks_lock:
            if self._state == 0:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        fn(self)

    def _set(self, result, error: Optional[BaseException]) -> None:
        self._result = result
        self._error = error
        with _callbacks_lock:
            callbacks = self._callbacks
            self._state = 1
        if callbacks:
            self._callbacks = None
            self._cb_thread = threading.get_ident()
            for fn in callbacks:
                try:
                    fn(self)
                except Exception as exc:  # noqa: BLE001 - the engine goes on; whoever waits gets it
                    logger.error("aiacc: a completion callback of tensor %r failed: %r", self.name, exc)
                    if self._error is None:
                        self._error = exc
            self._cb_thread = None
        self._state = 2
        _notify(self._wake)


_NO_WAKER = threading.Condition(threading.Lock())  # what handles without a waker (none in a job) wait on


def _notify(waker: Optional["Waker"]) -> None:
    """Wake the threads blocked in ``wait()`` (after ``_state`` became 2): only while some wait."""
    done = _NO_WAKER if waker is None else waker.done
    if waker is None or waker.waiters:
        with done:
            done.notify_all()


def finish_allreduces(reqs, inflight: dict) -> None:
    """Complete allreduce requests with their outputs, as ``_set(result, None)`` does one by one, taking
    the callbacks lock once for all of them (a training step completes hundreds at a time); their names
    leave ``inflight``. Those with completion callbacks finish through ``_set``."""
    leave = inflight.pop
    later = None
    with _callbacks_lock:
        for r in reqs:
            leave(r.name, None)
            v = r.value  # (Request.result(), inlined: a call less per tensor of a step)
            r._result = v if v is not None else r.outputs[0] if r.single else r.outputs
            if r._callbacks is None:
                r._state = 2
            elif later is None:
                later = [r]
            else:
                later.append(r)
    if reqs:
        _notify(reqs[0]._wake)  # (one waker: the engine's)
    if later is not None:
        for r in later:
            r._set(r._result, None)


class Waker:
    """Tells the engine that someone is blocked on a handle: it then starts cycles at once
    (no pause, no gathering) for as long as anyone waits."""

    __slots__ = ("urgent", "wake", "waiters", "helper", "_lock", "done", "cycle_thread")

    def __init__(self, urgent: threading.Event, wake: threading.Event):
        self.urgent, self.wake = urgent, wake
        self.waiters = 0
        self.done = threading.Condition(threading.Lock())  # notified when handles finish (Handle.wait)
        # helper(handle, deadline) -> bool: runs the engine's cycles on the waiting thread when none is running,
        # until the handle is done (True) or ``_now()`` passes ``deadline`` (None: no deadline)
        self.helper: Optional[Callable[["Handle", Optional[float]], bool]] = None
        # the thread running the engine's cycle now (ident): a wait there (in a callback) would never end
        self.cycle_thread: Optional[int] = None
        self._lock = threading.Lock()

    def set(self) -> None:
        # Event.set takes a Condition and notifies: only when not set already (a waited step sets
        # them once, not once per handle)
        if not self.urgent.is_set():
            self.urgent.set()
        if not self.wake.is_set():
            self.wake.set()

    def begin(self) -> None:
        with self._lock:
            self.waiters += 1
        self.set()

    def quiet_begin(self) -> None:
        """A waiting thread that runs the cycles itself: counted (the transport hurries), nothing woken."""
        with self._lock:
            self.waiters += 1

    def end(self) -> None:
        with self._lock:
            self.waiters -= 1


class Request(Handle):
    """One submitted operation on this rank; it is also the handle the caller waits on.

    ``flat_inputs`` / ``flat_outputs``: 1-D views of the arrays (outputs None until the engine
    allocates them). The timeline's timestamps (``t_seen``, ``t_agreed``, ``t_pack``, ``t_comm``,
    ``t_unpack``) are set only while a timeline is written.
    """

    __slots__ = ("kind", "meta", "priority", "inputs", "flat_inputs", "outputs", "flat_outputs",
                 "dtypes", "splits", "allocate", "remaining", "t_submit", "t_seen", "t_agreed",
                 "t_pack", "t_comm", "t_unpack", "compression", "single", "wires", "value")

    def __init__(self, name, kind, meta, priority, inputs, outputs, wake, splits, allocate, compression):
        """A request of a list of tensors (a group); one tensor's request is made by ``_one``."""
        # Handle's fields, set here: a training step creates many requests
        self.name = name
        self._wake = wake
        self._state = 0
        self._error = None
        self._callbacks = None
        self.kind = kind
        self.meta = meta
        self.priority = priority
        self.inputs = inputs
        self.outputs = outputs
        self.single = False
        self.flat_inputs = flat_inputs = [a if a.ndim == 1 else a.reshape(-1) for a in inputs]
        if outputs is None:
            self.flat_outputs = None
        elif all(map(operator.is_, outputs, inputs)):  # in place
            self.flat_outputs = flat_inputs
        else:
            self.flat_outputs = [a if a.ndim == 1 else a.reshape(-1) for a in outputs]
        self.dtypes = dtypes = [a.dtype for a in inputs]
        self.wires = dtypes if compression is _NONE else [compression.wire_dtype(d) for d in dtypes]
        self.splits = splits
        self.allocate = allocate
        self.compression = compression
        self.remaining = 1
        self.value = None
        self.t_submit = _now()

    def alloc(self, shape, dtype):
        """A new output array: the adapter's allocator, else aligned host memory or device memory."""
        if self.allocate is not None:
            return self.allocate(shape, dtype)
        return devices.empty(shape, dtype, self.meta.device)

    def alloc_apart(self, index: int, shape, dtype):
        """``alloc`` of the output of input ``index``, which MPI must not receive into memory it sends from:
        where the adapter's allocator hands back memory that overlaps the input (torch FSDP gathers a shard
        that is a view of the output), the input travels from a copy. (Lists replaced, not changed: they may
        be the caller's.)"""
        out = self.alloc(shape, dtype)
        inp = self.inputs[index]
        if self.allocate is not None and out.nbytes and inp.nbytes:
            a, b = devices.data_ptr(inp), devices.data_ptr(out)
            if a < b + out.nbytes and b < a + inp.nbytes:
                self.inputs = [*self.inputs[:index], inp.copy(), *self.inputs[index + 1:]]
                self.flat_inputs = [x if x.ndim == 1 else x.reshape(-1) for x in self.inputs]
        return out

    def ensure_outputs(self) -> None:
        if self.outputs is None:
            self.outputs = [self.alloc(a.shape, a.dtype) for a in self.inputs]
            self.flat_outputs = [a.reshape(-1) for a in self.outputs]

    def result(self):
        """What ``wait()`` returns for an allreduce: the output array, or the list of them; or the
        ``value`` an adapter gave at submit (its own tensor, whose memory the output array is)."""
        if self.value is not None:
            return self.value
        return self.outputs[0] if self.single else self.outputs

    def stamp(self, attribute: str, default=None):
        """A timeline timestamp, or ``default`` when it was not set."""
        return getattr(self, attribute, default)


def scale_factor(name, label: str, value) -> float:
    """``value`` (a ``prescale_factor`` / ``postscale_factor``) as a finite float; else an error naming the tensor
    and the argument (a NaN would be reported as differing across ranks: NaN != NaN). A string is refused,
    as Horovod's (``float("2")`` would take it)."""
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        factor = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"tensor {name!r}: {label}={value!r} is not a number") from None
    if not math.isfinite(factor):
        raise InvalidArgumentError(f"tensor {name!r}: {label}={factor} is not a finite number")
    return factor


def as_priority(name, value) -> float:
    """``priority`` as a float; else a TypeError naming the tensor (a string too)."""
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"tensor {name!r}: priority={value!r} is not a number") from None


def _one(name, kind, meta, priority, array, outputs, wake, splits, allocate, compression, dtypes=None,
         wires=None, value=None) -> Request:
    """The request of one tensor (``single``), built field by field: a training step makes one per tensor.
    Few new objects (each one the garbage collector tracks costs a training step time: measured 0.25 ms of
    a 1000-tensor step's 1.6 ms of submits went to collections): in place, ``inputs`` is the caller's
    ``outputs`` list, a 1-D tensor is its own flat view, and ``dtypes`` / ``wires`` are tuples shared by
    every request of the signature (read only, like every list of a request)."""
    req = _new(Request)
    req.name = name
    req._wake = wake
    req._state = 0
    req._error = req._callbacks = None
    req.kind = kind
    req.meta = meta
    req.priority = priority
    req.single = True
    req.outputs = outputs
    o = None if outputs is None else outputs[0]
    req.inputs = inputs = outputs if o is array else [array]
    req.flat_inputs = flat_inputs = inputs if array.ndim == 1 else [array.reshape(-1)]
    if o is array:
        req.flat_outputs = flat_inputs
    else:
        req.flat_outputs = None if o is None else [o if o.ndim == 1 else o.reshape(-1)]
    if dtypes is None:
        dtypes, wires = _dtypes_of(array.dtype, compression)
    req.dtypes = dtypes
    req.wires = wires
    req.splits = splits
    req.allocate = allocate
    req.compression = compression
    req.remaining = 1
    req.value = value
    req.t_submit = _now()
    return req


def _dtypes_of(dtype: np.dtype, compression) -> tuple:
    """A single-tensor request's ``dtypes`` and ``wires`` (the dtype on the wire after ``compression``)."""
    dtypes = (dtype,)
    return dtypes, dtypes if compression is _NONE else (compression.wire_dtype(dtype),)


def _check_op(kind: Collective, name: str, op: ReduceOp, arrays, size: int, labels=()) -> None:
    """Average of bool tensors has no meaning (the logical or of the ranks, divided by their number,
    would come out all False): refused, naming the tensor, before it reaches any rank's engine. So are
    Min, Max and Product of complex tensors (torch.distributed refuses them too), and
    Adasum where aiacc does not run it (``execution.adasum``: allreduce of floating-point host arrays on a
    power-of-two number of ranks, as Horovod's CPU Adasum; not a gradient bucket, which fuses layers
    that Adasum must combine one by one)."""
    if op == ReduceOp.ADASUM:
        what = f"{kind} of tensor {name!r} with op=Adasum"
        if kind != Collective.ALLREDUCE:
            raise NotImplementedError(f"{what}: Adasum is an allreduce; use Average or Sum")
        if labels:
            raise NotImplementedError(f"{what}: a gradient bucket fuses many layers, which Adasum combines one "
                                      "by one; reduce each gradient on its own with op=Adasum (as the gradient "
                                      "wrappers given op=Adasum do), or use Average")
        # the tensor first: it is wrong at any number of ranks (an int32 tensor at 3 ranks was refused for the
        # number alone, and at 4 ranks then for its dtype); both wrong, one message names both
        bad = next((a for a in arrays if a.__class__ is not _NDARRAY or a.dtype.kind != "f"), None)
        if bad is not None:
            given = dtype_name(bad.dtype) if bad.__class__ is _NDARRAY else \
                "a CUDA array" if devices.device_of(bad) == devices.CUDA else type(bad).__name__
            ranks = f"; it also runs on a power-of-2 number of ranks only, not {size}" if size & (size - 1) else ""
            raise TypeError(f"{what}: Adasum combines float16, float32 and float64 host arrays (as Horovod), not "
                            f"{given} (GPU tensors: reduce a CPU copy){ranks}")
        check_ranks(size, what)
        return
    if op == ReduceOp.AVERAGE and kind in (Collective.ALLREDUCE, Collective.REDUCESCATTER) and any(
            a.dtype == np.bool_ for a in arrays):
        raise TypeError(f"{kind} of tensor {name!r}: op=Average is not defined for bool tensors; use Sum or "
                        "Max (logical or) or Min or Product (logical and)")
    if op not in _NOT_COMPLEX:  # Sum, Average: one test
        return
    if op not in BITWISE:
        bad = next((a.dtype for a in arrays if a.dtype.kind == "c"), None)
        if bad is not None:
            raise TypeError(f"{kind} of tensor {name!r}: op={op} is not defined for complex tensors "
                            f"({dtype_name(bad)}); aiacc reduces them as pairs of reals, with Sum or Average only "
                            "(as torch.distributed)")
        return
    bad = next((a.dtype for a in arrays if a.dtype.kind not in "iub"), None)
    if bad is not None:
        raise TypeError(f"{kind} of tensor {name!r}: op={op} is a bitwise operation, defined for integer and "
                        f"bool tensors, not {dtype_name(bad)}")
    if any(not isinstance(a, _NDARRAY) for a in arrays):
        raise TypeError(f"{kind} of tensor {name!r}: op={op} is not available for GPU tensors (NCCL has no "
                        "bitwise reductions); reduce a CPU copy")


def check_root_rank(root, size: int, what: str) -> int:
    """``root`` as an int when it is a rank of a job of ``size`` ranks; else the one error every adapter
    and the engine raise for it, naming ``what`` (the call and its tensor) and the valid ranks."""
    try:
        value = operator.index(root)
    except TypeError:
        raise InvalidArgumentError(f"{what}: root_rank={root!r} is not a rank (a whole number)") from None
    if isinstance(root, (bool, np.bool_)):  # (True == 1, but a flag passed for a rank is a mistake)
        raise InvalidArgumentError(f"{what}: root_rank={root!r} is a bool, not a rank (a whole number: 0..{size - 1})")
    if not 0 <= value < size:
        raise InvalidArgumentError(f"{what}: root_rank={root!r} is out of range for a job of {size} "
                                   f"rank{'s' if size != 1 else ''} (valid: 0..{size - 1})")
    return value


def check_name(kind: Collective, name) -> None:
    """A tensor's name is a string (or None: matched by call order); else the error every adapter raises,
    also one that builds names itself (TensorFlow's graphs). A str subclass (numpy's ``str_``, read from an array
    of names) is a string: ``RequestFactory.make`` takes it as the plain ``str`` of the same text."""
    if name is not None and not isinstance(name, str):
        raise TypeError(f"{kind}: name={name!r} must be a string, not {type(name).__name__}")


def check_rows(kind: Collective, name: str, ndim: int, index: Optional[int] = None) -> None:
    """Collectives that split or join rows (allgather, alltoall, reducescatter) need a first dimension: the
    error for a 0-d tensor (``index``: its place in a group), which adapters that know shapes before they run
    (TensorFlow's graphs) raise early with the same words."""
    if ndim == 0:
        which = f"tensor {name!r}" if index is None else f"tensor {index} of group {name!r}"
        raise InvalidArgumentError(f"{kind} of {which} needs at least one dimension (got a scalar)")


class RequestFactory:
    """Builds :class:`Request` objects from ``submit()`` arguments, on the caller's thread."""

    def __init__(self, rank: int, size: int, waker: Waker):
        self.rank = rank
        self.size = size
        self._waker = waker
        self._noname = collections.Counter()
        self._lock = threading.Lock()
        # (dtype, shape, op, prescale, postscale, compression, array type) -> (Meta, dtypes, wires) of a
        # single-tensor allreduce
        self._metas: dict = {}

    def make(self, kind, arrays, name, op, root, prescale, postscale, compression, priority, outputs, splits,
             allocate, labels: Tuple[str, ...] = ()) -> Request:
        if kind.__class__ is not Collective:
            kind = Collective(kind)
        if name is None:
            with self._lock:
                self._noname[kind] += 1
                name = f"{kind}.noname.{self._noname[kind]}"
        elif name.__class__ is not str:
            check_name(kind, name)
            name = str.__str__(name)  # (a str subclass: the same name as the plain str, on every rank)
        if op.__class__ is not ReduceOp:
            op = as_reduce_op(op)
        comp: Compressor = compression if isinstance(compression, Compressor) else as_compressor(compression)
        single = arrays.__class__ is not list and arrays.__class__ is not tuple
        if kind is _ALLREDUCE and single and not labels:
            return self.allreduce(arrays, name, op, prescale, postscale, comp, as_priority(name, priority), outputs,
                                  allocate)
        arrays = [check_array(arrays, name)] if single else \
            [check_array(a, name, f"tensor {i} of group") for i, a in enumerate(arrays)]  # (which one is at fault)
        if outputs is not None:
            outputs = [maybe_output(o, a, name) for o, a in zip(outputs, arrays)]
        _check_op(kind, name, op, arrays, self.size, labels)
        if kind is not _ALLREDUCE:
            self._check_kind(kind, name, arrays, root)
            if kind is Collective.ALLTOALL:
                splits = self._check_splits(name, arrays[0], splits)
            entries = tuple((dtype_name(a.dtype), ((-1,) + a.shape[1:]) if kind in _FREE_FIRST_DIM else a.shape)
                            for a in arrays)
        else:
            if not arrays:
                raise ValueError(f"allreduce of {name!r}: no tensors given")
            entries = tuple((dtype_name(a.dtype), a.shape) for a in arrays)
        device = self._device_of(arrays, name)
        # (the root of a broadcast; of an allreduce whose root alone keeps the result: torch's reduce)
        meta = Meta(int(kind), int(op), int(root) if kind in (Collective.BROADCAST, _ALLREDUCE) else 0,
                    scale_factor(name, "prescale_factor", prescale), scale_factor(name, "postscale_factor", postscale),
                    comp.name, entries, device, tuple(labels))
        if single:
            return _one(name, kind, meta, as_priority(name, priority), arrays[0], outputs, self._waker, splits, allocate,
                        comp)
        return Request(name, kind, meta, as_priority(name, priority), arrays, outputs, self._waker, splits, allocate,
                       comp)

    def allreduce(self, array, name, op, prescale, postscale, compression, priority, outputs, allocate,
                  value=None) -> Request:
        """The common case, one tensor reduced, with its signature from the cache. ``value``: what the
        handle's ``wait()`` returns instead of the output array (an adapter's tensor)."""
        # (``carray``: C-contiguous, aligned and writeable, in one attribute)
        if array.__class__ is not _NDARRAY or array.dtype not in _SUPPORTED or not array.flags.carray:
            array = check_array(array, name)
            if outputs is not None:  # (a read-only input is fine, but not in place)
                outputs = [maybe_output(outputs[0], array, name)]
        elif outputs is not None and outputs[0] is not array:
            outputs = [maybe_output(outputs[0], array, name)]
        if compression is None:
            compression = _NONE
        elif not isinstance(compression, Compressor):
            compression = as_compressor(compression)
        key = (array.dtype, array.shape, op, prescale, postscale, compression, array.__class__)
        try:
            known = self._metas.get(key)
        except TypeError:  # an unhashable factor (a TensorFlow tensor, an array): scale_factor below names it
            known = key = None
        if known is None:
            if op.__class__ is not ReduceOp:
                op = as_reduce_op(op)
            _check_op(Collective.ALLREDUCE, name, op, (array,), self.size)
            if len(self._metas) > 4096:
                self._metas.clear()
            device = devices.CPU if array.__class__ is _NDARRAY else devices.device_of(array)
            meta = Meta(int(_ALLREDUCE), int(op), 0, scale_factor(name, "prescale_factor", prescale),
                        scale_factor(name, "postscale_factor", postscale), compression.name,
                        ((dtype_name(array.dtype), array.shape),), device)
            known = (meta, *_dtypes_of(array.dtype, compression))
            if key is not None:
                self._metas[key] = known
        return _one(name, _ALLREDUCE, known[0], priority, array, outputs, self._waker, None, allocate, compression,
                    known[1], known[2], value)

    @staticmethod
    def _device_of(arrays, name: str) -> str:
        # host arrays only: CPU (a grouped list is checked whole: a CUDA member among host ones is an error)
        if all(a.__class__ is _NDARRAY for a in arrays):
            return devices.CPU
        found = {devices.device_of(a) for a in arrays}
        if len(found) > 1:
            raise InvalidArgumentError(f"grouped tensors {name!r} mix host and CUDA arrays; submit them separately")
        return found.pop() if found else devices.CPU

    def _check_kind(self, kind: Collective, name: str, arrays, root) -> None:
        if not arrays and kind not in (Collective.BARRIER, Collective.JOIN):
            raise InvalidArgumentError(f"{kind} of {name!r}: no tensors given")
        if kind is Collective.BROADCAST:
            check_root_rank(root, self.size, f"broadcast of tensor {name!r}")
        if kind is Collective.ALLTOALL and len(arrays) != 1:
            raise InvalidArgumentError(f"alltoall of {name!r} takes one tensor (got {len(arrays)})")
        if kind in (Collective.ALLGATHER, Collective.ALLTOALL, Collective.REDUCESCATTER):
            for i, a in enumerate(arrays):
                check_rows(kind, name, a.ndim, i if len(arrays) > 1 else None)

    def _check_splits(self, name, array, splits):
        first = array.shape[0]
        if splits is None:
            if first % self.size:
                raise InvalidArgumentError(f"alltoall of tensor {name!r}: first dimension {first} is not divisible "
                                           f"by {self.size} ranks; pass splits")
            return np.full(self.size, first // self.size, dtype=np.int64)
        given = listed_splits(name, splits) if isinstance(splits, (list, tuple)) else np.asarray(splits)
        if given.size and given.dtype.kind not in "iu":  # 1.5 rows or True rows are a mistake, not a count
            raise InvalidArgumentError(f"alltoall of tensor {name!r}: splits must have an integer dtype, got "
                                       f"{given.dtype} values {given.reshape(-1).tolist()}")
        splits = given.astype(np.int64).reshape(-1)
        if splits.size != self.size or (splits < 0).any() or splits.sum() != first:
            raise InvalidArgumentError(f"alltoall of tensor {name!r}: splits {splits.tolist()} must be {self.size} "
                                       f"non-negative numbers summing to the first dimension {first}")
        return splits


def listed_splits(name, splits) -> np.ndarray:
    """alltoall's ``splits`` given as a list or tuple, as int64 counts: whole floats count (``[rows / size] * size``;
    Horovod casts a list), anything else (1.5 rows, True rows) is an InvalidArgumentError."""
    given = np.asarray(splits)
    if given.size and given.dtype.kind not in "iu" and not (
            given.dtype.kind == "f" and np.isfinite(given).all() and (given == given.round()).all()):
        raise InvalidArgumentError(f"alltoall of tensor {name!r}: splits must hold whole numbers, got {given.dtype} "
                                   f"values {given.reshape(-1).tolist()}")
    return given.astype(np.int64)
