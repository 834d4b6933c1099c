"""TensorFlow tensors <-> the engine's numpy arrays, without copies where that is safe.

Measured with TF 2.21 / numpy 1.26 on CPU (see tests/workers/tf_ops.py, which checks the pointers):

* eager tensor -> numpy: ``np.from_dlpack(t)`` is a read-only view of the tensor's own buffer
  (``t.numpy()`` copies); the engine only reads its inputs, so read-only is fine.
* numpy -> eager tensor: ``tf.experimental.dlpack.from_dlpack(a.__dlpack__())`` wraps the array's memory
  (``tf.convert_to_tensor`` copies). TensorFlow aborts the whole process on a DLPack buffer that is not
  64-byte aligned, so :func:`from_numpy` hands it only aligned arrays: the engine allocates results with
  ``aiacc.tensors.aligned_empty``; any other array is first copied into an aligned one.
* inside ``tf.function`` the engine is reached through ``tf.numpy_function``, whose inputs are views of
  the graph's tensors and whose 64-byte aligned outputs become tensors without a copy.
* bfloat16 has no DLPack code in numpy 1.26: it crosses as uint16 (``tf.bitcast``, also without copy)
  and is viewed as ``ml_dtypes.bfloat16`` on the numpy side.
* a tensor on another device (GPU) cannot be viewed from numpy: ``to_numpy`` copies it to host.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from aiacc.compression import bfloat16_dtype
from aiacc.tensors import ALIGNMENT, aligned_empty, supported_dtypes
from aiacc.tensors import check_dtype as core_check_dtype

__all__ = ["to_numpy", "from_numpy", "check_dtype", "graph_dtype", "to_graph_input", "from_graph_output",
           "numpy_in", "numpy_out", "is_aligned"]

_SUPPORTED = tuple(tf.as_dtype(d) for d in supported_dtypes())  # what the engine carries


def check_dtype(tensor, name) -> None:
    """The core's TypeError naming the tensor when the engine cannot carry its dtype."""
    if tensor.dtype not in _SUPPORTED:
        core_check_dtype(None, name, shown=tensor.dtype.name)


def is_aligned(array: np.ndarray) -> bool:
    return array.__array_interface__["data"][0] % ALIGNMENT == 0


def _aligned_copy(array: np.ndarray) -> np.ndarray:
    copy = aligned_empty(array.shape, array.dtype)
    copy[...] = array
    return copy


def to_numpy(tensor: tf.Tensor) -> np.ndarray:
    """A numpy view of an eager tensor's memory (read-only; a host copy for non-CPU tensors)."""
    if tensor.dtype == tf.bfloat16:
        return to_numpy(tf.bitcast(tensor, tf.uint16)).view(bfloat16_dtype())
    try:
        return np.from_dlpack(tensor)
    except (BufferError, RuntimeError, TypeError, ValueError):
        return tensor.numpy()  # not host memory: one copy to host


def from_numpy(array: np.ndarray) -> tf.Tensor:
    """An eager tensor over ``array``'s memory (no copy) if it is 64-byte aligned and writeable; else over an
    aligned copy, because TensorFlow aborts the process on an unaligned DLPack buffer."""
    array = np.asarray(array)
    if array.dtype == bfloat16_dtype():
        return tf.bitcast(from_numpy(array.view(np.uint16)), tf.bfloat16)
    if not (is_aligned(array) and array.flags.c_contiguous and array.flags.writeable):
        array = _aligned_copy(array)
    return tf.experimental.dlpack.from_dlpack(array.__dlpack__())


# ---- inside tf.function: the dtypes that cross a numpy_function boundary --------------------
def graph_dtype(dtype: tf.DType) -> tf.DType:
    """The dtype a tensor of ``dtype`` has at the numpy_function boundary (bfloat16 travels as uint16)."""
    return tf.uint16 if dtype == tf.bfloat16 else dtype


def to_graph_input(tensor: tf.Tensor) -> tf.Tensor:
    return tf.bitcast(tensor, tf.uint16) if tensor.dtype == tf.bfloat16 else tensor


def from_graph_output(tensor: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    return tf.bitcast(tensor, tf.bfloat16) if dtype == tf.bfloat16 else tensor


def numpy_in(array: np.ndarray, dtype: tf.DType) -> np.ndarray:
    """The engine's view of a numpy_function input of original dtype ``dtype``."""
    return array.view(bfloat16_dtype()) if dtype == tf.bfloat16 else array


def numpy_out(array: np.ndarray) -> np.ndarray:
    """A numpy_function output TensorFlow adopts without a copy: aligned (bfloat16 as uint16)."""
    array = np.asarray(array)
    if array.dtype == bfloat16_dtype():
        array = array.view(np.uint16)
    if not is_aligned(array) or not array.flags.c_contiguous:
        array = _aligned_copy(array)
    return array
