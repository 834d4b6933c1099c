"""Gradient compression on the wire: none, fp16, bf16.

Compression is applied by the engine while it packs a fusion buffer (cast to
the wire type) and undone while it unpacks (cast back), so it is written once
for every framework. Adapters expose these same objects as
``hvd.Compression.none`` / ``.fp16`` / ``.bf16``.

Only floating-point tensors wider than the wire type are compressed; integer
and already-narrow tensors travel unchanged.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from . import half

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression", "bfloat16_dtype",
           "TensorCompressor", "tensor_compression", "cast_into", "set_cast_kernel"]

# Below this many elements a cast goes through numpy (a kernel call costs microseconds).
CAST_KERNEL_MIN_ELEMENTS = 1 << 14
_cast_kernel: Optional[Callable] = None


def set_cast_kernel(kernel: Optional[Callable]) -> None:
    """A faster cast between host arrays, from an adapter: ``kernel(dst, src) -> bool`` writes ``src``
    cast to ``dst``'s dtype into ``dst`` (same shape) and returns True, or returns False where it cannot.
    numpy 1.26 converts float16 one element at a time (~0.7 G elements/s here; torch's vectorized cast
    ~8 G/s), and a compressed allreduce casts every element three to four times. None: numpy only."""
    global _cast_kernel
    _cast_kernel = kernel


def cast_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src``, cast to ``dst``'s dtype (through the adapter's kernel where one is set)."""
    kernel = _cast_kernel
    if kernel is not None and dst.size >= CAST_KERNEL_MIN_ELEMENTS and dst.dtype != src.dtype and kernel(dst, src):
        return
    # numpy's own bits, a sum beyond float16's range inf, silently, as in torch; float16 <-> float32 / float64 without
    # numpy's element-by-element cast, which crawls through float16's subnormal range (|x| < 6.1e-5, where most
    # gradient values lie): what TensorFlow's and MXNet's 16-bit buckets and sums, with no kernel, went through
    half.cast(dst, src)


def bfloat16_dtype() -> Optional[np.dtype]:
    """numpy's bfloat16 from ml_dtypes, or None where ml_dtypes is not installed."""
    try:
        import ml_dtypes  # noqa: PLC0415 - optional
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


class Compressor:
    """Chooses the dtype a tensor travels in; the engine does the casts."""

    name = "none"

    def wire_dtype(self, dtype: np.dtype) -> np.dtype:
        return np.dtype(dtype)

    # Horovod-style helpers for users who call a compressor directly on arrays.
    def compress(self, array: np.ndarray):
        wire = self.wire_dtype(array.dtype)
        return (array if wire == array.dtype else array.astype(wire)), array.dtype

    def decompress(self, array: np.ndarray, ctx):
        return array if ctx is None or array.dtype == ctx else array.astype(ctx)

    def __repr__(self) -> str:
        return f"Compression.{self.name}"

    def __reduce__(self):  # singletons survive pickling (they travel in negotiation metadata)
        return (_by_name, (self.name,))


class NoneCompressor(Compressor):
    name = "none"


class _CastCompressor(Compressor):
    _target: Optional[np.dtype] = None

    def wire_dtype(self, dtype: np.dtype) -> np.dtype:
        dtype = np.dtype(dtype)
        target = self._target
        if target is None or dtype.kind != "f" or dtype.itemsize <= target.itemsize:
            return dtype
        return target


class FP16Compressor(_CastCompressor):
    name = "fp16"
    _target = np.dtype(np.float16)


class BF16Compressor(_CastCompressor):
    name = "bf16"

    @property
    def _target(self):  # type: ignore[override]
        bf16 = bfloat16_dtype()
        if bf16 is None:
            raise ImportError("Compression.bf16 needs ml_dtypes (pip install ml_dtypes)")
        return bf16


class Compression:
    """The available compressors (Horovod's ``Compression`` namespace)."""

    none = NoneCompressor()
    fp16 = FP16Compressor()
    bf16 = BF16Compressor()


_BY_NAME = {"none": Compression.none, "fp16": Compression.fp16, "bf16": Compression.bf16}


def _by_name(name: str) -> Compressor:
    return _BY_NAME[name]


def as_compressor(value) -> Compressor:
    """Accept a core compressor, its name, None, or an adapter's Compression object with a ``name``."""
    if value is None:
        return Compression.none
    if isinstance(value, Compressor):
        return value
    name = value if isinstance(value, str) else getattr(value, "name", None)
    if isinstance(name, str) and name.lower() in _BY_NAME:
        return _BY_NAME[name.lower()]
    if custom_compressor(value) is not None:
        raise ValueError(f"compression={value!r}: a compressor of your own (Horovod's Compressor with compress / "
                         "decompress) is not supported here: aiacc compresses inside its engine, by the dtype the "
                         "tensors travel in; use Compression.none, .fp16 or .bf16 (the torch and TensorFlow "
                         "allreduce and grouped_allreduce apply one around the reduction, as Horovod's)")
    raise ValueError(f"compression={value!r} is not supported; use Compression.none, .fp16 or .bf16")


def custom_compressor(value):
    """``value`` when it is a compressor of one's own (``compress`` / ``decompress``, none of aiacc's), else None:
    the adapters' ``allreduce`` / ``grouped_allreduce`` apply it around the reduction, as Horovod's do
    (compress, reduce, decompress; autograd goes through all three)."""
    if value is None or isinstance(value, (str, Compressor, TensorCompressor)):
        return None
    name = getattr(value, "name", None)
    if isinstance(name, str) and name.lower() in _BY_NAME:
        return None
    return value if callable(getattr(value, "compress", None)) and callable(getattr(value, "decompress", None)) else None


class CustomCompressor:
    """Horovod's base class of compressors of one's own (``compress(tensor) -> (tensor, ctx)``,
    ``decompress(tensor, ctx)``), which the adapters export as ``compression.Compressor`` so that scripts
    importing it run. torch's and TensorFlow's ``allreduce`` / ``grouped_allreduce`` apply a subclass around the
    reduction (``custom_compressor``); where aiacc compresses inside the engine (a wire dtype), ``compression=``
    refuses it by name (``as_compressor``). The built-in ones are ``NoneCompressor``, ``FP16Compressor`` and
    ``BF16Compressor`` (the adapters' ``Compression.none`` / ``.fp16`` / ``.bf16``)."""

    @staticmethod
    def compress(tensor):
        """(``tensor`` compressed, what ``decompress`` needs)."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        """``tensor`` as it was before ``compress``."""
        raise NotImplementedError


class TensorCompressor:
    """A core compressor with Horovod's ``compress`` / ``decompress`` on a framework's tensors, for scripts
    that call them directly. The rule (which dtype travels) is the core's ``wire_dtype``; the adapter only
    gives its dtype conversions and its cast. The engine reads ``name`` and casts on the wire by itself.

    ``numpy_dtype``: framework dtype -> numpy dtype; ``framework_dtype``: the reverse; ``cast(tensor,
    framework dtype)``."""

    def __init__(self, core: Compressor, numpy_dtype: Callable, framework_dtype: Callable, cast: Callable):
        self.core = core
        self.name = core.name
        self._numpy_dtype, self._framework_dtype, self._cast = numpy_dtype, framework_dtype, cast

    def compress(self, tensor):
        """(the tensor in its wire dtype, its own dtype): floating-point tensors wider than the wire type are
        cast, everything else is returned as it is."""
        native = np.dtype(self._numpy_dtype(tensor.dtype))
        wire = self.core.wire_dtype(native)
        return (tensor if wire == native else self._cast(tensor, self._framework_dtype(wire))), tensor.dtype

    def decompress(self, tensor, ctx):
        """``tensor`` back in the dtype ``compress`` returned as ``ctx``."""
        return tensor if ctx is None or tensor.dtype == ctx else self._cast(tensor, ctx)

    def __repr__(self) -> str:
        return f"Compression.{self.name}"


def tensor_compression(numpy_dtype: Callable, framework_dtype: Callable, cast: Callable) -> type:
    """An adapter's ``Compression`` namespace (``none``, ``fp16``, ``bf16``) of :class:`TensorCompressor`."""
    made = {name: TensorCompressor(core, numpy_dtype, framework_dtype, cast) for name, core in _BY_NAME.items()}
    return type("Compression", (), {"__doc__": Compression.__doc__, **made})
