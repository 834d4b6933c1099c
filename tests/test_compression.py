"""The core's compression rule on a framework's tensors (aiacc.compression.tensor_compression), with numpy
arrays standing in for the framework: what ``compress`` casts, and that ``decompress`` restores the dtype.
(On TensorFlow tensors: tests/workers/tf_horovod.py.)"""

import numpy as np

from aiacc.compression import tensor_compression

Compression = tensor_compression(numpy_dtype=np.dtype, framework_dtype=np.dtype, cast=lambda a, d: a.astype(d))


def test_fp16_casts_wider_floats_only():
    for dtype, wire in [(np.float64, np.float16), (np.float32, np.float16), (np.float16, np.float16),
                        (np.int32, np.int32), (np.uint8, np.uint8), (np.bool_, np.bool_)]:
        a = np.ones(3, dtype)
        compressed, ctx = Compression.fp16.compress(a)
        assert compressed.dtype == wire and ctx == np.dtype(dtype), (dtype, compressed.dtype, ctx)
        restored = Compression.fp16.decompress(compressed, ctx)
        assert restored.dtype == np.dtype(dtype) and np.array_equal(restored, a)


def test_none_changes_nothing_and_names_reach_the_engine():
    a = np.ones(3, np.float64)
    compressed, ctx = Compression.none.compress(a)
    assert compressed is a and Compression.none.decompress(compressed, ctx) is a
    assert [Compression.none.name, Compression.fp16.name, Compression.bf16.name] == ["none", "fp16", "bf16"]
    assert repr(Compression.fp16) == "Compression.fp16"
