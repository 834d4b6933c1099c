"""``hvd.Compression`` for TensorFlow: the core's compressors, whose ``compress`` / ``decompress`` also work on
TensorFlow tensors (Horovod's API). The engine casts on the wire by itself; these objects carry the
choice's name to it (``compression=`` of the collectives and of ``DistributedGradientTape``)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from aiacc.compression import CustomCompressor, bfloat16_dtype, tensor_compression

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor"]


def _numpy_dtype(dtype: tf.DType) -> np.dtype:
    return bfloat16_dtype() if dtype == tf.bfloat16 else np.dtype(dtype.as_numpy_dtype)


Compression = tensor_compression(_numpy_dtype, tf.as_dtype, tf.cast)
# Horovod's names in this module: its base class of compressors of one's own (see
# aiacc.compression.CustomCompressor: where it is applied, where refused) and the built-in ones
Compressor = CustomCompressor
NoneCompressor, FP16Compressor, BF16Compressor = Compression.none, Compression.fp16, Compression.bf16
