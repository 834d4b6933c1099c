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
    assert_ok(aiaccrun(2, "custom_compressor.py", timeout=240), 2, checks=13)


def _bits(a):
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.itemsize])


def _numpys(src, dtype):
    with np.errstate(all="ignore"):
        return src.astype(dtype)


def test_fast_float16_casts_give_numpys_bits():
    """aiacc.half.cast (the engine's float16 casts for Adasum) against numpy's own casts, bit for bit: every
    float16 widened; float32 and float64 rounded to float16 on random bit patterns (every exponent), on each
    float16 midpoint nudged by float64 amounts that float32 cannot hold (where rounding through float32 would
    differ), at the subnormal and overflow edges, signed zeros, infinities and NaN payloads; blocks of any
    length, small arrays (numpy's path) and other shapes."""
    from aiacc.half import MIN_ELEMENTS, cast

    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    for dtype in (np.float32, np.float64):
        for src in (every, every[:MIN_ELEMENTS - 1], np.tile(every, 4)[: 200_004].reshape(4, -1)):
            dst = np.empty(src.shape, dtype)
            cast(dst, src)
            assert np.array_equal(_bits(dst), _bits(_numpys(src, dtype))), (dtype, src.shape)

    rng = np.random.default_rng(5)
    f32 = rng.integers(0, 1 << 32, 300_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    near = rng.integers(0x33000000 - 5000, 0x47800000 + 5000, 300_000, dtype=np.uint32).view(np.float32)
    grid = np.arange(0x3300_0000, 0x3900_0000, 257, dtype=np.uint32).view(np.float32)  # subnormals and ties
    f64 = rng.integers(0, (1 << 64) - 1, 300_000, dtype=np.uint64, endpoint=True).view(np.float64)
    wide = (f64.view(np.uint64) & np.uint64(0x800FFFFFFFFFFFFF)) | (
        rng.integers(0x3D0, 0x412, 300_000, dtype=np.uint64) << np.uint64(52))
    h = every[:0x7C00].astype(np.float64)
    mid = np.concatenate([(h[:-1] + h[1:]) / 2, [65520.0, 2.0 ** -25]])
    ties = np.concatenate([mid * (1 + s) for s in (0.0, 2.0 ** -30, -2.0 ** -30, 2.0 ** -40, -2.0 ** -52)])
    edges = np.array([0.0, -0.0, np.inf, -np.inf, 65504.0, 65519.99, 65520.0, 1e300, -1e-300, 3.5e38, 1e-45])
    nans32 = (rng.integers(0, 1 << 23, 1000, dtype=np.uint32) | np.uint32(0x7F800001)).view(np.float32)
    nans64 = (rng.integers(1, 1 << 52, 1000, dtype=np.uint64) | np.uint64(0xFFF0000000000000)).view(np.float64)
    for src in (f32, near, grid, nans32, np.concatenate([near, nans32]), near[:MIN_ELEMENTS - 1],
                f64, wide.view(np.float64), ties, -ties, edges, np.concatenate([ties, edges, nans64]),
                ties[:MIN_ELEMENTS - 1], ties[:66_000].reshape(3, -1)):
        dst = np.empty(src.shape, np.float16)
        cast(dst, src)
        assert np.array_equal(_bits(dst), _bits(_numpys(src, np.float16))), (src.dtype, src.shape)
    assert not np.array_equal(_bits(_numpys(ties.astype(np.float32), np.float16)),
                              _bits(_numpys(ties, np.float16)))  # (the ties are where a float32 step would differ)
    other = np.empty(5, np.float32)
    cast(other, np.arange(5.0))  # other dtypes: numpy's cast
    assert np.array_equal(other, np.arange(5.0, dtype=np.float32))


def test_float64_to_float16_rounds_once_with_torchs_cast_kernel():
    """With aiacc.torch imported, the engine's casts of large host arrays go through torch's kernel, which
    rounds float64 -> float16 through float32 (twice): a float64 array of 2^15 elements cast for fp16
    compression came out 1.0 where numpy (and the same array under 2^14 elements) gives 1 + 2^-10. Every
    size rounds once now."""
    pytest.importorskip("torch")
    import aiacc.torch  # noqa: F401 - installs the cast kernel
    from aiacc import compression

    assert compression._cast_kernel is not None
    x = 1 + 2.0 ** -11 + 2.0 ** -40  # a float16 tie only after rounding to float32
    for n in (8, compression.CAST_KERNEL_MIN_ELEMENTS, 1 << 15):
        dst = np.empty(n, np.float16)
        compression.cast_into(dst, np.full(n, x))
        assert np.all(dst == np.float16(1 + 2.0 ** -10)), (n, dst[0])
    dst = np.empty(1 << 15, np.float16)
    compression.cast_into(dst, np.full(1 << 15, x, np.float32))  # float32 -> float16: torch's kernel, one rounding
    assert np.all(dst == np.float16(1.0))
