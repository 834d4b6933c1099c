"""Adasum (Horovod's ``op=Adasum``): combining the ranks' gradients so that parallel ones are averaged and
orthogonal ones added (Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021).

Two vectors combine as ``a' = (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b``; the ranks combine pairwise in a
tree, rank r with rank r ^ d for d = 1, 2, 4, ... (the pairing of Horovod's vector-halving distance-doubling
Adasum, so results agree with its). Here every pair exchanges whole vectors (``sendrecv``) and both partners
compute the same combination, with the lower rank's vector as ``a``, in float64 (dot products and norms of
float16 gradients would underflow or overflow in their own precision; Horovod too sums them in double):
after the log2(size) levels every rank holds the same bytes, rounded once to the tensor's dtype. A
coefficient stays 1 where its vector's squared norm is below the square root of float64's smallest normal
number (Horovod's guard against dividing by nothing).

Cost: log2(size) exchanges of the whole tensor in float64 per rank (Horovod's halving sends each level half
of what the level before did); four float64 copies of the tensor in memory at the peak. Correctness first: Adasum is an
opt-in op for a few large-batch runs, not the default data path. Under float16 compression its casts are
``half.cast``: numpy's own, one element at a time, took ~20x the rest of Adasum on the small values of a
step's change (ResNet-18, 2 ranks: 1.5 s of engine CPU per step, 0.06 s uncompressed; 0.16 s with half.cast).
"""

from __future__ import annotations

import numpy as np

from .half import cast

__all__ = ["combine", "adasum", "check_ranks"]

# a coefficient stays 1 below this squared norm (sqrt of float64's smallest normal, as Horovod's sqrt_double_min)
_TINY = float(np.sqrt(np.finfo(np.float64).tiny))


def check_ranks(size: int, what: str) -> None:
    """NotImplementedError naming ``what`` unless ``size`` ranks are a power of 2 (as Horovod's CPU Adasum)."""
    if size & (size - 1):
        raise NotImplementedError(f"{what}: Adasum runs on a power-of-2 number of ranks, not {size} (as "
                                  "Horovod's CPU Adasum)")


def combine(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out`` = Adasum of float64 vectors ``a`` (the lower rank's) and ``b``; ``out`` may be ``a`` or ``b``."""
    dot = float(np.dot(a, b))
    anorm = float(np.dot(a, a))
    bnorm = float(np.dot(b, b))
    acoeff = 1.0 - dot / anorm * 0.5 if anorm >= _TINY else 1.0
    bcoeff = 1.0 - dot / bnorm * 0.5 if bnorm >= _TINY else 1.0
    return np.add(acoeff * a, bcoeff * b, out=out)  # (the same expression on both partners: the same bytes)


def adasum(x: np.ndarray, rank: int, size: int, sendrecv, wire=None, sent=None) -> np.ndarray:
    """Adasum over ``size`` ranks (a power of 2) of this rank's float64 vector ``x`` (overwritten).
    ``sendrecv(send, partner, recv)`` exchanges whole vectors with rank ``partner``. Under compression
    (``wire``: float16 or bfloat16) the vectors travel in ``wire``: each level rounds ``x`` to it first, so
    both partners combine the same values, and the result is rounded to it at the end (Horovod compresses
    before its Adasum allreduce and decompresses after); ``sent``: ``x`` in ``wire`` already (``x`` holds its
    values), which the first level sends as it is. Returns ``x``; under compression the result in ``wire``
    (``send`` or ``sent``), ``x`` left with the last level's combination before that rounding."""
    other = np.empty_like(x)
    narrow = wire is not None and np.dtype(wire) != x.dtype
    if narrow:
        send = sent if sent is not None else np.empty(x.shape, wire)
        recv = np.empty(x.shape, wire)
        rounded = sent is not None  # (rounding x again would give the same bits)
    d = 1
    while d < size:
        partner = rank ^ d
        if narrow:
            if not rounded:
                cast(send, x)
                cast(x, send)
            sendrecv(send, partner, recv)
            cast(other, recv)
            rounded = False
        else:
            sendrecv(x, partner, other)
        if rank < partner:
            combine(x, other, out=x)
        else:
            combine(other, x, out=x)
        d <<= 1
    if narrow:
        if not rounded:
            cast(send, x)
        return send
    return x
