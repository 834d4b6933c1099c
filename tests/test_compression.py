"""The core's compression rule on a framework's tensors (aiacc.compression.tensor_compression), with numpy
arrays standing in for the framework: what ``compress`` casts, and that ``decompress`` restores the dtype.
(On TensorFlow tensors: tests/workers/tf_horovod.py.)"""

import numpy as np
import pytest

from aiacc.compression import tensor_compression
from conftest import aiaccrun, assert_ok

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


@pytest.mark.parametrize("np_,per_host,kernel", [(2, 0, ""), (3, 0, "torch"), (3, 2, ""), (2, 1, "torch"),
                                                 (4, 2, "torch")])
def test_16bit_sums_accumulate_in_float32_and_agree_on_every_rank(np_, per_host, kernel):
    """fp16 / bf16 sums (compressed float32, or 16-bit arrays) on one host, on hosts of unequal size (flat),
    on one-rank hosts and on two emulated hosts of two ranks (within the host, then across: the one
    4-rank job, a few seconds), with numpy's casts and with the torch adapter's cast kernel. An Average (or a
    postscale) is applied before the 16-bit rounding: 40000 averaged over the ranks is 40000, not inf."""
    env = {"AIACC_HOSTS_PER_NODE": str(per_host)} if per_host else {}
    job = aiaccrun(np_, "sum16.py", *([kernel] if kernel else []), env=env)
    assert_ok(job, np_, checks=52 if kernel else 51)
    levels = 2 if (np_, per_host) == (4, 2) else 1  # unequal hosts reduce flat, in one level
    assert job.output.count(f"levels={levels}") == np_, job.output


def test_compressors_of_ones_own_as_horovods_allreduce_applies_them():
    """Horovod's ``Compressor`` subclasses: allreduce / grouped_allreduce (torch, TensorFlow, eager and in
    tf.function, autograd) reduce what ``compress`` made and ``decompress`` it; the optimizers refuse one by name;
    Horovod's compressor names import from each framework's ``compression`` module."""
    assert_ok(aiaccrun(2, "custom_compressor.py", timeout=240), 2, checks=9)
