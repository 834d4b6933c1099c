"""Where an array lives: host (numpy) or CUDA device (cupy), and the matching array module.

The core never imports cupy until it meets a CUDA array, so a machine
without a GPU needs neither cupy nor a driver.
"""

from __future__ import annotations

import numpy as np

from .tensors import aligned_empty

__all__ = ["CPU", "CUDA", "device_of", "array_module", "empty", "data_ptr"]

CPU = "cpu"
CUDA = "cuda"


def device_of(a) -> str:
    if isinstance(a, np.ndarray):
        return CPU
    return CUDA if hasattr(a, "__cuda_array_interface__") else CPU


def array_module(device: str):
    if device == CUDA:
        import cupy  # noqa: PLC0415 - only for CUDA arrays

        return cupy
    return np


def empty(shape, dtype, device: str = CPU):
    if device == CUDA:
        return array_module(CUDA).empty(shape, dtype)
    return aligned_empty(shape, dtype)


def data_ptr(a) -> int:
    if isinstance(a, np.ndarray):
        return a.__array_interface__["data"][0]
    return a.__cuda_array_interface__["data"][0]
