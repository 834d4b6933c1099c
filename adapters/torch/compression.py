"""``hvd.Compression`` for torch: the core's compressors, whose ``compress`` / ``decompress`` also work on
torch tensors (Horovod's API). The engine casts on the wire by itself (the core decides the wire dtype,
for every framework alike); these objects carry the choice's name to it."""

from __future__ import annotations

import numpy as np
import torch

from aiacc.compression import CustomCompressor, bfloat16_dtype, set_cast_kernel, tensor_compression

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor"]

_TORCH = {np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32,
          np.dtype(np.float64): torch.float64}


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    if dtype == torch.bfloat16:
        return bfloat16_dtype()
    return torch.empty(0, dtype=dtype).numpy().dtype


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.bfloat16 if dtype == bfloat16_dtype() else _TORCH[np.dtype(dtype)]


Compression = tensor_compression(_numpy_dtype, _torch_dtype, lambda tensor, dtype: tensor.to(dtype))
# Horovod's names in this module: its base class of compressors of one's own (see
# aiacc.compression.CustomCompressor: where it is applied, where refused) and the built-in ones
Compressor = CustomCompressor
NoneCompressor, FP16Compressor, BF16Compressor = Compression.none, Compression.fp16, Compression.bf16


_F16, _F64 = np.dtype(np.float16), np.dtype(np.float64)
_FLOATS = frozenset((_F16, np.dtype(np.float32), _F64))


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    if array.dtype in _FLOATS:
        return torch.from_numpy(array)
    if array.dtype == bfloat16_dtype():
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    raise TypeError(array.dtype)


def _cast(dst: np.ndarray, src: np.ndarray) -> bool:
    """The engine's casts between float dtypes of host arrays, by torch (F16C-vectorized: ~10x numpy's
    float16 casts here). False for what torch cannot view without a copy (read-only, odd strides), and for
    float64 -> float16, which torch rounds twice (through float32: 1 + 2^-11 + 2^-40 becomes 1, not 1 + 2^-10):
    aiacc.half.cast rounds it once, as numpy and every smaller array do."""
    if not (src.flags.writeable and dst.flags.writeable):
        return False  # torch.from_numpy warns on read-only arrays
    if dst.dtype == _F16 and src.dtype == _F64:
        return False
    try:
        _as_tensor(dst).copy_(_as_tensor(src))
    except (TypeError, ValueError, RuntimeError):
        return False
    return True


set_cast_kernel(_cast)
