"""``hvd.Compression`` for torch: the core's compressors, whose ``compress`` / ``decompress`` also work on
torch tensors (Horovod's API). The engine casts on the wire by itself (the core decides the wire dtype,
for every framework alike); these objects carry the choice's name to it."""

from __future__ import annotations

import numpy as np
import torch

from aiacc.compression import bfloat16_dtype, tensor_compression

__all__ = ["Compression"]

_TORCH = {np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32,
          np.dtype(np.float64): torch.float64}


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    if dtype == torch.bfloat16:
        return bfloat16_dtype()
    return torch.empty(0, dtype=dtype).numpy().dtype


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.bfloat16 if dtype == bfloat16_dtype() else _TORCH[np.dtype(dtype)]


Compression = tensor_compression(_numpy_dtype, _torch_dtype, lambda tensor, dtype: tensor.to(dtype))
