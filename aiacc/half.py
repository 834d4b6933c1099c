"""numpy's float16 casts, bit for bit, without numpy's element-by-element loop.

numpy 1.26 converts to and from float16 one element at a time, slowest in float16's subnormal range
(|x| < 6.1e-5, where much of an SGD step's change lies at a learning rate of 0.01): measured here, ~5 M
elements/s to float16 there (36x slower than for normal numbers) and ~30 M/s from it. Adasum under fp16 compression casts every element of every delta
(compress it, widen both partners' vectors to float64, round the result, widen it back): on ResNet-18 at
2 ranks that took ~1.5 s of the engine's CPU per step, against ~0.06 s for all of Adasum uncompressed.

:func:`cast` gives the bits of ``np.copyto(dst, src, casting="unsafe")`` for every value (rounding, signed
zeros, overflow to inf, NaN payloads) with whole-array operations on blocks that stay in cache:

- float16 -> float32 / float64: a 65,536-entry table of numpy's own conversion of each float16;
- float32 -> float16: rounding to nearest even on the bit pattern; the normal range with an integer add
  and shift, the subnormal range with a float32 addition of 0.5, which the CPU rounds to a multiple of
  2^-24 (float16's subnormal step); overflow to inf; NaNs by numpy itself;
- float64 -> float16: to float32 rounding to odd (a value that is no float32 becomes the odd one of its
  two neighbours), then as above. Rounding to odd with two or more extra bits, then to nearest even, is
  one rounding to nearest (Boldo & Melquiond, "When double rounding is odd", 2005); plain float32 in
  between is not (1 + 2^-11 + 2^-40 rounds to 1 + 2^-10 directly, to 1 through float32: torch's cast
  does the latter).

An overflow to inf is silent, as in ``compression.cast_into``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["cast"]

# Below this many elements numpy's own cast costs less than the block operations' calls.
MIN_ELEMENTS = 512
_BLOCK = 1 << 16  # elements per block (the fastest here: the scratch arrays stay small, in cache)

_F16, _F32, _F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
_U32 = np.uint32
_WIDE = (_F32, _F64)
_tables: dict = {}


def _table(dtype: np.dtype) -> np.ndarray:
    """numpy's conversion of every float16 (indexed by its bits) to ``dtype``."""
    table = _tables.get(dtype)
    if table is None:
        table = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(dtype)
        _tables[dtype] = table
    return table


def cast(dst: np.ndarray, src: np.ndarray) -> None:
    """``np.copyto(dst, src, casting="unsafe")``, bit for bit; fast where one side is float16 and the other
    float32 or float64 (C-contiguous arrays of the same shape)."""
    if (dst.size >= MIN_ELEMENTS and dst.shape == src.shape and dst.flags.c_contiguous and src.flags.c_contiguous
            and dst.flags.writeable):
        if dst.dtype == _F16 and src.dtype in _WIDE:
            _to_half(dst.reshape(-1), src.reshape(-1))
            return
        if src.dtype == _F16 and dst.dtype in _WIDE:
            _from_half(dst.reshape(-1), src.reshape(-1))
            return
    with np.errstate(over="ignore"):
        np.copyto(dst, src, casting="unsafe")


def _from_half(dst: np.ndarray, src: np.ndarray) -> None:
    table, bits = _table(dst.dtype), src.view(np.uint16)
    for lo in range(0, src.size, _BLOCK):
        np.take(table, bits[lo:lo + _BLOCK], out=dst[lo:lo + _BLOCK], mode="clip")  # (clip: no buffered out)


def _to_half(dst: np.ndarray, src: np.ndarray) -> None:
    n, out = src.size, dst.view(np.uint16)
    m = min(n, _BLOCK)
    a, b, c, low = np.empty(m, _U32), np.empty(m, _U32), np.empty(m, _U32), np.empty(m, bool)
    if src.dtype == _F64:
        y, back, mag = np.empty(m, np.float32), np.empty(m, _F64), np.empty(m, _F64)
        inexact, away = np.empty(m, bool), np.empty(m, bool)
    with np.errstate(all="ignore"):
        for lo in range(0, n, _BLOCK):
            hi = min(n, lo + _BLOCK)
            k = hi - lo
            part = src[lo:hi]
            if src.dtype == _F64:
                part = _to_odd32(part, y[:k], back[:k], mag[:k], inexact[:k], away[:k])
            _bits16(part.view(_U32), out[lo:hi], a[:k], b[:k], c[:k], low[:k])
        nan = np.isnan(src)
        if nan.any():  # numpy's NaN payloads (its float64 -> float16 keeps other bits than float32 keeps)
            dst[nan] = src[nan].astype(np.float16)


def _to_odd32(x: np.ndarray, y: np.ndarray, back: np.ndarray, mag: np.ndarray, inexact: np.ndarray,
              away: np.ndarray) -> np.ndarray:
    """``y`` = float64 ``x`` rounded to float32 to odd: truncated toward zero, its last bit set if inexact."""
    np.copyto(y, x, casting="unsafe")  # to nearest even
    np.copyto(back, y)
    np.not_equal(back, x, out=inexact)
    np.abs(back, out=back)
    np.abs(x, out=mag)
    np.greater(back, mag, out=away)  # rounded away from zero: one step back (its magnitude is > 0)
    bits = y.view(_U32)
    np.subtract(bits, away, out=bits, casting="unsafe")
    np.bitwise_or(bits, inexact, out=bits, casting="unsafe")
    return y


def _bits16(u: np.ndarray, out: np.ndarray, a: np.ndarray, b: np.ndarray, c: np.ndarray, low: np.ndarray) -> None:
    """``out`` = the float16 bits of float32 bits ``u``, rounded to nearest even (NaNs: any NaN)."""
    np.bitwise_and(u, _U32(0x7FFFFFFF), out=a)  # |x|
    np.right_shift(a, _U32(13), out=b)
    np.bitwise_and(b, _U32(1), out=b)  # the last bit kept: a tie rounds to even
    np.add(b, a, out=b)
    np.add(b, _U32(0xC8000FFF), out=b)  # exponent 127 -> 15 bias (mod 2^32), plus half a step less one
    np.right_shift(b, _U32(13), out=b)
    np.minimum(b, _U32(0x7C00), out=b)  # overflow: inf
    np.add(a.view(np.float32), np.float32(0.5), out=c.view(np.float32))  # |x| < 2^-14: rounded to k * 2^-24
    np.subtract(c, _U32(0x3F000000), out=c)  # k
    np.less(a, _U32(0x38800000), out=low)
    np.subtract(c, b, out=c)
    np.multiply(c, low, out=c)
    np.add(b, c, out=b)  # b = k where |x| < 2^-14
    np.right_shift(u, _U32(16), out=c)
    np.bitwise_and(c, _U32(0x8000), out=c)
    np.bitwise_or(b, c, out=out, casting="unsafe")
