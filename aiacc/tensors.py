"""What the engine accepts as a tensor, and how it allocates aligned memory."""

from __future__ import annotations

from typing import Optional

import numpy as np

from .compression import bfloat16_dtype

__all__ = ["supported_dtypes", "check_dtype", "check_array", "aligned_empty", "ALIGNMENT"]

# TensorFlow aborts the process on a DLPack buffer that is not 64-byte aligned;
# every buffer the engine allocates is aligned to this.
ALIGNMENT = 64

_BASE = (np.float16, np.float32, np.float64, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.int64, np.bool_,
         np.complex64, np.complex128)


def supported_dtypes() -> tuple:
    """Dtypes every collective accepts (bfloat16 where ml_dtypes is installed)."""
    found = tuple(np.dtype(d) for d in _BASE)
    bf16 = bfloat16_dtype()
    return found + ((bf16,) if bf16 is not None else ())


_SUPPORTED = None
_NAMES = {}


def check_dtype(dtype, name: str, what: str = "tensor", shown: Optional[str] = None) -> None:
    """Raise TypeError naming the tensor unless the engine carries numpy dtype ``dtype`` (None: a framework
    dtype numpy has no counterpart for). ``shown``: the dtype's name in the message (the framework's own,
    where an adapter checks a framework tensor). The one dtype rule and message of every adapter."""
    global _SUPPORTED
    if _SUPPORTED is None:
        _SUPPORTED = frozenset(supported_dtypes())
    if dtype is not None and np.dtype(dtype) in _SUPPORTED:
        return
    if dtype is not None and not np.dtype(dtype).isnative and np.dtype(dtype).newbyteorder("=") in _SUPPORTED:
        dtype = np.dtype(dtype)
        raise TypeError(f"{what} {name!r} has dtype {dtype.name} in non-native byte order ({dtype.str!r}); aiacc "
                        "communicates arrays in this machine's byte order: pass array.astype(array.dtype."
                        "newbyteorder('='))")
    names = ", ".join(sorted(d.name for d in _SUPPORTED))
    raise TypeError(f"{what} {name!r} has dtype {shown or np.dtype(dtype).name}, which aiacc does not support; "
                    f"supported: {names}")


def dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, cached (numpy computes it anew on every access)."""
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = dtype.name
    return name


def check_array(array, name: str, what: str = "tensor") -> np.ndarray:
    """Return ``array`` as an ndarray if the engine can send it; else raise naming the tensor."""
    global _SUPPORTED
    if _SUPPORTED is None:
        _SUPPORTED = frozenset(supported_dtypes())
    if array.__class__ is np.ndarray and array.dtype in _SUPPORTED and array.flags.c_contiguous:
        return array  # the common case, checked cheaply
    if hasattr(array, "__cuda_array_interface__") and not isinstance(array, np.ndarray):
        return _check_device_array(array, name, what)
    if not isinstance(array, np.ndarray):
        try:
            array = np.asarray(array)
        except Exception as exc:  # noqa: BLE001
            raise TypeError(f"{what} {name!r}: {type(array).__name__} is not an array ({exc})") from None
    check_dtype(array.dtype, name, what)
    if not array.flags.c_contiguous:
        raise ValueError(
            f"{what} {name!r} is not C-contiguous (strides {array.strides} for shape {array.shape}); "
            "pass a contiguous array (np.ascontiguousarray / tensor.contiguous())"
        )
    return array


def _check_device_array(array, name: str, what: str):
    check_dtype(array.dtype, name, what)
    if not array.flags.c_contiguous:
        raise ValueError(f"{what} {name!r} is not C-contiguous (strides {array.strides} for shape {array.shape}); "
                         "pass a contiguous array")
    return array


def aligned_empty(shape, dtype, alignment: int = ALIGNMENT) -> np.ndarray:
    """An uninitialised C-contiguous array whose data pointer is ``alignment``-byte aligned."""
    dtype = np.dtype(dtype)
    shape = tuple(int(s) for s in np.atleast_1d(shape)) if not isinstance(shape, tuple) else shape
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    offset = (-raw.ctypes.data) % alignment
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


def maybe_output(output: Optional[np.ndarray], like: np.ndarray, name: str) -> Optional[np.ndarray]:
    """Validate an output buffer given by an adapter (same shape and dtype as the input); the input itself
    (in place) must be writeable."""
    if output is None:
        return output
    if output is like:
        return check_writeable(output, name)
    if not hasattr(output, "shape") or isinstance(output, np.generic):  # a list, a number, a numpy scalar
        what = f"a numpy scalar ({type(output).__name__}), not an array" if isinstance(output, np.generic) else \
            type(output).__name__
        raise TypeError(f"tensor {name!r}: an in-place operation writes its result into a numpy array; got "
                        f"{what} (the operation without the trailing _ returns a new array)")
    if output.shape != like.shape or output.dtype != like.dtype or type(output) is not type(like):
        raise ValueError(
            f"output for tensor {name!r} has shape {output.shape} and dtype {output.dtype}; "
            f"expected {like.shape} and {like.dtype}"
        )
    if not output.flags.c_contiguous or not getattr(output.flags, "writeable", True):
        raise ValueError(f"output for tensor {name!r} must be a writeable C-contiguous array")
    return output


def check_writeable(array, name: str):
    """``array``, if an in-place operation may write its result into it; else ValueError naming the tensor (MPI
    would refuse the read-only buffer inside the engine, ending the job)."""
    if array.__class__ is np.ndarray and not array.flags.writeable:
        raise ValueError(f"tensor {name!r} is a read-only array; an in-place operation (allreduce_, "
                         "grouped_allreduce_, ...) writes its result into it: pass a writeable array (array.copy()), "
                         "or call the operation that returns a new array")
    return array


def dtype_from_name(name: str) -> np.dtype:
    """Inverse of ``dtype.name`` for every supported dtype (bfloat16 included)."""
    if name == "bfloat16":
        bf16 = bfloat16_dtype()
        if bf16 is None:
            raise TypeError("bfloat16 tensors need ml_dtypes (pip install ml_dtypes)")
        return bf16
    return np.dtype(name)
