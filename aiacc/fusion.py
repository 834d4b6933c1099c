"""Fusion: many small allreduces become one collective on one buffer.

``plan`` walks the responses in scheduled order and puts allreduces that can
travel together (same wire dtype, same reduce op) into buckets of up to the
fusion threshold; a grouped allreduce always lands whole in one bucket per
dtype. ``pack`` copies (and casts, and prescales) the inputs into a fusion
buffer, ``unpack`` copies results out, applying the average and postscale.

A bucket holding a single uncompressed, unscaled tensor is reduced directly
in its output array: no fusion copy for big tensors.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np

from .ops import Collective, ReduceOp
from .tensors import aligned_empty

__all__ = ["Piece", "Bucket", "plan", "FusionBuffers", "pack", "unpack", "scale_for"]


class Piece:
    """One tensor (or one partition of one) inside a bucket."""

    __slots__ = ("response", "index", "start", "count", "offset", "dtype", "shape")

    def __init__(self, response, index: int, start: int, count: int, dtype: np.dtype, shape):
        self.response = response  # the agreed response (request may be None on a joined rank)
        self.index = index  # which tensor of the (grouped) request
        self.start = start  # first element of this piece inside the tensor
        self.count = count  # elements
        self.offset = 0  # first element inside the bucket buffer
        self.dtype = dtype
        self.shape = shape

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize


class Bucket:
    """Pieces reduced by one collective."""

    __slots__ = ("wire", "op", "pieces", "count", "priority")

    def __init__(self, wire: np.dtype, op: ReduceOp, priority: float):
        self.wire = wire
        self.op = op
        self.pieces: List[Piece] = []
        self.count = 0
        self.priority = priority

    def add(self, piece: Piece) -> None:
        piece.offset = self.count
        self.pieces.append(piece)
        self.count += piece.count

    @property
    def nbytes(self) -> int:
        return self.count * self.wire.itemsize


def plan(items, threshold: int, wire_of) -> list:
    """Group ordered work into buckets.

    ``items`` are responses (non-allreduce, kept as they are) or lists of
    pieces of one allreduce response (its partitions, or the members of a
    group), in the order they should be sent. ``wire_of(piece)`` gives a
    piece's wire dtype. Returns Buckets and responses in send order. The
    pieces of a grouped allreduce stay together in one bucket per dtype.
    """
    out: list = []
    open_buckets = {}
    for item in items:
        if not isinstance(item, list):
            out.append(item)
            continue
        op = ReduceOp(item[0].response.meta.op)
        by_key = {}
        for p in item:
            by_key.setdefault((wire_of(p), op), []).append(p)
        grouped = len(item[0].response.meta.entries) > 1
        for key, pieces in by_key.items():
            for chunk in ([pieces] if grouped else [[p] for p in pieces]):
                size = sum(p.count for p in chunk) * key[0].itemsize
                bucket = open_buckets.get(key)
                if bucket is None or bucket.nbytes + size > threshold:
                    bucket = open_buckets[key] = Bucket(key[0], op, chunk[0].response.priority)
                    out.append(bucket)
                for p in chunk:
                    bucket.add(p)
    return out


class FusionBuffers:
    """One reusable, aligned buffer per wire dtype, grown on demand."""

    def __init__(self):
        self._buffers = {}

    def get(self, dtype: np.dtype, count: int) -> np.ndarray:
        buf = self._buffers.get(dtype)
        if buf is None or buf.size < count:
            size = max(count, 1024, 0 if buf is None else buf.size * 2)
            buf = self._buffers[dtype] = aligned_empty((size,), dtype)
        return buf[:count]

    def clear(self) -> None:
        self._buffers.clear()


def scale_for(meta, op: ReduceOp, contributors: int) -> float:
    """The factor applied after the reduction (postscale, and 1/n for Average)."""
    s = float(meta.postscale)
    if op == ReduceOp.AVERAGE:
        s /= contributors
    return s


def pack(bucket: Bucket, buf: np.ndarray) -> None:
    """Copy every piece's input into ``buf`` (cast to the wire dtype, prescaled)."""
    plain = []
    for p in bucket.pieces:
        req = p.response.request
        dst = buf[p.offset:p.offset + p.count]
        if req is None:  # this rank joined: it contributes zeros
            dst[...] = 0
            continue
        src = req.flat_inputs[p.index][p.start:p.start + p.count]
        pre = p.response.meta.prescale
        if pre != 1.0:
            np.multiply(src, pre, out=dst, casting="unsafe")
        else:
            plain.append((dst, src))
    if len(plain) == len(bucket.pieces) and len(plain) > 1 and all(s.dtype == buf.dtype for _, s in plain):
        # contiguous pieces in order: one C call instead of a Python loop
        np.concatenate([s for _, s in plain], out=buf[:bucket.count])
        return
    for dst, src in plain:
        np.copyto(dst, src, casting="unsafe")


def unpack(bucket: Bucket, buf: np.ndarray, contributors: int) -> None:
    """Copy results out of ``buf`` into every piece's output, applying average and postscale."""
    op = bucket.op
    integer = buf.dtype.kind in "iub"
    scales = [scale_for(p.response.meta, op, contributors) for p in bucket.pieces]
    uniform: Optional[float] = scales[0] if all(s == scales[0] for s in scales) else None
    if uniform is not None and not integer and all(p.dtype == buf.dtype for p in bucket.pieces):
        if uniform != 1.0:
            np.multiply(buf, uniform, out=buf)
        for p in bucket.pieces:
            req = p.response.request
            if req is not None:
                np.copyto(req.flat_outputs[p.index][p.start:p.start + p.count], buf[p.offset:p.offset + p.count])
        return
    for p, s in zip(bucket.pieces, scales):
        req = p.response.request
        if req is None:
            continue
        dst = req.flat_outputs[p.index][p.start:p.start + p.count]
        src = buf[p.offset:p.offset + p.count]
        finish(dst, src, op, s, p.response.meta.postscale, contributors)


def finish(dst: np.ndarray, src: np.ndarray, op: ReduceOp, scale: float, postscale: float, contributors: int) -> None:
    """``dst = src * scale`` with integer Average as floor division (src may be dst)."""
    if dst.dtype.kind in "iub" and op == ReduceOp.AVERAGE:
        np.floor_divide(src, contributors, out=dst, casting="unsafe")
        if postscale != 1.0:
            np.multiply(dst, postscale, out=dst, casting="unsafe")
    elif scale != 1.0:
        np.multiply(src, scale, out=dst, dtype=np.result_type(dst.dtype, np.float32) if dst.dtype.kind == "f" else None,
                    casting="unsafe")
    elif dst is not src:
        np.copyto(dst, src, casting="unsafe")


def is_allreduce(resp) -> bool:
    return resp.error is None and resp.meta.kind == Collective.ALLREDUCE
