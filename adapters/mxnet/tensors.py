"""NDArray <-> numpy without copies, through MXNet's DLPack export.

MXNet 1.9 NDArrays have no ``__dlpack__``: they hand out bare PyCapsules from
``to_dlpack_for_read()`` (waits until every pending *write* of the array is
done) and ``to_dlpack_for_write()`` (waits for pending reads *and* writes).
``np.from_dlpack`` only accepts objects with ``__dlpack__``, so a capsule is
wrapped in :class:`_Capsule`. numpy marks the view read-only; where the engine
must write (in-place collectives, the reduced gradient), :func:`writable_view`
re-exposes the same memory through ``__array_interface__`` with the read-only
flag cleared. Either way the numpy array keeps the DLPack tensor, and with it
MXNet's storage, alive for as long as the view exists.

The other direction, a result whose shape is known only at run time
(allgather, alltoall, reducescatter): the engine allocates a 64-byte aligned
numpy array and :func:`to_ndarray` lends it to MXNet with
``mx.nd.from_dlpack(array.__dlpack__())``, again without a copy.

Gradients take a third way (:mod:`aiacc.mxnet.gradients`): exported before
MXNet has computed them, without a wait, because MXNet's dependency engine
calls back when each one is final; ``DistributedTrainer`` then keeps them in
the core's bucket memory, lent to MXNet with ``mx.nd.from_dlpack``.

Cost (measured here): ``to_dlpack_for_read`` on a finished array ~4 us;
``to_dlpack_for_write`` ~80 us, because MXNet pushes an empty write op
through its engine and waits for it.

Copies that remain: none for allreduce / broadcast / gradients on their own
(a single tensor is reduced in place, a ``DistributedTrainer`` bucket too);
``DistributedTrainer``'s first step copies each gradient into its bucket once
(and a gradient MXNet replaces later, once); the engine's fusion buffer (pack and
unpack when several tensors travel together) and fp16/bf16 compression are
core copies shared by every framework; ``broadcast`` (not ``broadcast_``)
copies the root's input into the new result; ``alltoall``'s
``received_splits`` is a new tiny int32 NDArray; with aiacc disabled,
collectives return copies by design.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import numpy as np

import mxnet as mx
from mxnet.base import _LIB, check_call

from aiacc.tensors import check_dtype

__all__ = ["numpy_view", "writable_view", "writable_from_capsule", "to_ndarray", "empty_like", "check_ndarray",
           "like"]

_KDLCPU = 1
_BOOL = np.dtype(np.bool_)


class _Capsule:
    """What np.from_dlpack wants: an object with ``__dlpack__`` around MXNet's bare capsule."""

    __slots__ = ("_capsule",)

    def __init__(self, capsule):
        self._capsule = capsule

    def __dlpack__(self, stream=None):  # noqa: ARG002 - CPU only, no stream
        capsule, self._capsule = self._capsule, None
        return capsule

    def __dlpack_device__(self):
        return (_KDLCPU, 0)


class _WritableMemory:
    """The memory of a read-only numpy view, exposed again as writable (keeps the view alive)."""

    __slots__ = ("__array_interface__", "_view")

    def __init__(self, view: np.ndarray):
        iface = dict(view.__array_interface__)
        iface["data"] = (iface["data"][0], False)
        self.__array_interface__ = iface
        self._view = view


def check_ndarray(tensor, name: str, what: str = "tensor") -> None:
    """Raise a clear error for anything the engine cannot take without a copy."""
    if not isinstance(tensor, mx.nd.NDArray):
        raise TypeError(f"{what} {name!r}: expected an mxnet NDArray, got {type(tensor).__name__}")
    if tensor.stype != "default":
        fix = ("make its layer with dense gradients (sparse_grad=False, as for Horovod's MXNet API, which "
               "takes none either)" if what == "gradient" else "convert it with .tostype('default')")
        raise TypeError(f"{what} {name!r} has storage type {tensor.stype!r}; aiacc.mxnet reduces dense "
                        f"NDArrays only: {fix}")
    if tensor.context.device_type != "cpu":
        raise ValueError(f"{what} {name!r} lives on {tensor.context}; aiacc.mxnet works on CPU NDArrays "
                         "(context mx.cpu())")
    if np.dtype(tensor.dtype).names == ("bfloat16",):  # what MXNet's bfloat16 is to numpy (a 'void16' record)
        raise TypeError(f"{what} {name!r} is a bfloat16 NDArray, which aiacc.mxnet does not take (numpy refuses "
                        "MXNet 1.9's bfloat16 DLPack export, and Horovod's MXNet API takes none either): cast "
                        "it with .astype('float32') first")
    check_dtype(tensor.dtype, name, what)  # the core's rule: every other dtype MXNet has


class _Memory:
    """An NDArray's memory as numpy sees it through ``__array_interface__`` (keeps the NDArray alive)."""

    __slots__ = ("__array_interface__", "_tensor")

    def __init__(self, tensor, writable: bool):
        pointer = ctypes.c_void_p()
        check_call(_LIB.MXNDArrayGetData(tensor.handle, ctypes.byref(pointer)))
        self.__array_interface__ = {"data": (pointer.value, not writable), "shape": tuple(tensor.shape),
                                    "typestr": np.dtype(tensor.dtype).str, "version": 3}
        self._tensor = tensor


def _bool_view(tensor, writable: bool, exclusive: bool) -> np.ndarray:
    """A numpy view of a bool NDArray, whose DLPack export MXNet 1.9 gets wrong in both directions
    ("Unknown DLDataType", a NULL without an exception): its data pointer, once MXNet's pending writes
    (and, ``exclusive``, reads) of it are done, as ``to_dlpack_for_read`` / ``_for_write`` wait."""
    if writable and exclusive:
        check_call(_LIB.MXNDArrayWaitToWrite(tensor.handle))
    else:
        tensor.wait_to_read()
    if tensor.size == 0:
        return np.empty(tensor.shape, _BOOL)
    return np.asarray(_Memory(tensor, writable))


def numpy_view(tensor, name: str, what: str = "tensor") -> np.ndarray:
    """A read-only numpy view of ``tensor``'s memory once MXNet has finished writing it.

    Blocks (with the GIL released) only until the operations that produce ``tensor`` are done.
    """
    check_ndarray(tensor, name, what)
    if tensor.dtype == _BOOL:
        return _bool_view(tensor, False, False)
    return np.from_dlpack(_Capsule(tensor.to_dlpack_for_read()))


def writable_view(tensor, name: str, what: str = "tensor", exclusive: bool = True) -> np.ndarray:
    """A writable numpy view of ``tensor``'s memory.

    ``exclusive=True`` also waits until MXNet has no pending *reads* of the array
    (``to_dlpack_for_write``), so writing cannot change what an earlier queued
    operation sees. ``exclusive=False`` waits for pending writes only: for arrays
    nobody else reads before the caller has waited for the engine (a fresh output,
    or gradients between ``backward()`` and the optimizer).
    """
    check_ndarray(tensor, name, what)
    if tensor.dtype == _BOOL:
        return _bool_view(tensor, True, exclusive)
    return writable_from_capsule(tensor.to_dlpack_for_write() if exclusive else tensor.to_dlpack_for_read())


def writable_from_capsule(capsule) -> np.ndarray:
    """A writable numpy view of the memory an MXNet DLPack capsule exports."""
    return np.asarray(_WritableMemory(np.from_dlpack(_Capsule(capsule))))


def empty_like(tensor, shape: Optional[tuple] = None):
    """A fresh NDArray on ``tensor``'s context, for results."""
    return mx.nd.empty(tensor.shape if shape is None else shape, ctx=tensor.context, dtype=tensor.dtype)


def to_ndarray(array: np.ndarray, ctx=None):
    """An NDArray over ``array``'s memory (no copy); MXNet keeps ``array`` alive. A bool array is copied
    (MXNet 1.9 cannot import bool memory through DLPack)."""
    if array.size == 0 or array.dtype == _BOOL:
        return mx.nd.array(array, ctx=ctx or mx.cpu(), dtype=array.dtype)
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    out = mx.nd.from_dlpack(array.__dlpack__())
    if ctx is not None and out.context != ctx:
        out = out.as_in_context(ctx)
    return out


def like(out, tensor):
    """``out`` as the kind of array ``tensor`` is: an ``mx.np.ndarray`` (numpy semantics, ``npx.set_np()``) for one,
    over the same memory, since MXNet's numpy operators refuse legacy NDArrays; else ``out`` itself."""
    if isinstance(tensor, mx.np.ndarray) and not isinstance(out, mx.np.ndarray):
        return out.as_np_ndarray()
    return out
