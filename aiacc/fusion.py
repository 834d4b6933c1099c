"""Fusion: many small allreduces become one collective on one buffer.

``plan`` walks the scheduled work in order and puts allreduce pieces that
can travel together (same wire dtype, reduce op, device and postscale) into buckets of up to
the fusion threshold; a grouped allreduce always lands whole in one bucket
per dtype. ``pack`` copies (and casts, and prescales) the inputs into a
fusion buffer, ``unpack`` copies results out, applying the average and
postscale.

The common case -- whole tensors, no cast, no prescale, one scale for all --
is packed by one ``np.concatenate`` call and scaled by one multiply over the
whole buffer; only the copy back into each output is per tensor. A bucket
holding a single uncompressed, unscaled tensor is reduced directly in its
output array by the engine: no fusion copy for big tensors.
"""

from __future__ import annotations

import operator
import re
from typing import List, Optional

import numpy as np

from .compression import cast_into
from .ops import ReduceOp
from .devices import data_ptr, empty
from .names import BUCKET_SETUP_PREFIX
from .tensors import dtype_from_name

__all__ = ["Piece", "Bucket", "Run", "plan", "plan_cached", "PlanCache", "FusionBuffers", "pack", "unpack",
           "scale_for", "finish", "identity", "cast_copy"]

_AVERAGE = int(ReduceOp.AVERAGE)
# The results of the gradient buckets' one-time setup (their Sum allreduces, ``buckets._gather_setup``) that this
# rank took part in after it had called ``join()``, by name: the rank's own buckets, set up at its first step after
# the join (the next epoch of an uneven loop), take the layout the others agreed on from here, since the others
# never run that setup again (the rank ran it alone and waited for ever).
SEEN_WHILE_JOINED: dict = {}
_SETUP = re.compile(re.escape(BUCKET_SETUP_PREFIX) + r"\d+\.(size|data)")
_SUM = int(ReduceOp.SUM)
_MIN = int(ReduceOp.MIN)
_PRODUCT = int(ReduceOp.PRODUCT)
_BAND = int(ReduceOp.BAND)
_BITWISE = frozenset(int(o) for o in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR))
_new = object.__new__


class Piece:
    """One tensor (or one partition of one) to be allreduced."""

    __slots__ = ("response", "index", "start", "count", "dtype", "wire", "op", "src", "dst", "offset", "device")

    def __init__(self, response, index: int, start: int, count: int, dtype: np.dtype, wire: np.dtype, src, dst):
        self.response = response  # the agreed response (its request is None on a joined rank)
        self.index = index  # which tensor of a grouped request
        self.start = start  # first element of this piece inside the tensor
        self.count = count  # elements
        self.dtype = dtype
        self.wire = wire  # dtype on the wire (compression)
        self.op = response.meta.op
        self.device = response.meta.device  # "cpu" or "cuda": never fused together
        self.src = src  # flat input view (None on a joined rank)
        self.dst = dst  # flat output view (None on a joined rank)
        self.offset = 0  # first element inside the bucket buffer

    @property
    def nbytes(self) -> int:
        return self.count * self.wire.itemsize

    @property
    def whole(self) -> bool:
        """The whole of a single-tensor request (not a partition, not part of a group)."""
        req = self.response.request
        return req is not None and req.single and self.start == 0 and self.count == req.flat_inputs[0].size


class Bucket:
    """Pieces reduced by one collective.

    ``plain``: every piece present, uncast, unprescaled, and one postscale for all: the buffer is
    packed by one concatenate and scaled by one multiply. ``whole``: also every piece is a whole
    single-tensor request, so the bucket can be described by its requests and offsets alone (a
    plan the engine reuses when the same tensors are agreed together again).
    """

    __slots__ = ("wire", "op", "pieces", "count", "nbytes", "priority", "plain", "whole", "postscale", "device")

    def __init__(self, wire: np.dtype, op: int, priority: float, device: str = "cpu"):
        self.device = device
        self.wire = wire
        self.op = op
        self.pieces: List[Piece] = []
        self.count = 0
        self.nbytes = 0
        self.priority = priority
        self.plain = True
        self.whole = True
        self.postscale: Optional[float] = None  # shared postscale, or None if they differ

    def add(self, piece: Piece) -> None:
        piece.offset = self.count
        meta = piece.response.meta
        if not self.pieces:
            self.postscale = meta.postscale
        elif self.postscale is not None and meta.postscale != self.postscale:
            self.postscale = None
            self.plain = self.whole = False
        if self.plain and (piece.src is None or meta.prescale != 1.0 or piece.dtype != self.wire):
            self.plain = self.whole = False
        if self.whole and not piece.whole:
            self.whole = False
        self.pieces.append(piece)
        self.count += piece.count
        self.nbytes += piece.count * self.wire.itemsize


def plan(items, threshold: int) -> list:
    """Group scheduled work into buckets, keeping the order.

    ``items``: Pieces (a tensor or one partition of it), lists of Pieces (a
    grouped allreduce, kept together) or responses of other collectives.
    Returns Buckets and those responses, in send order. A piece of a buffer
    that already fuses many tensors (a gradient bucket: its signature has
    ``labels``) gets a bucket of its own: it is reduced where it lies.
    """
    out: list = []
    open_buckets = {}
    for item in items:
        if item.__class__ is Piece:
            if item.response.meta.labels:
                bucket = Bucket(item.wire, item.op, item.response.priority, item.device)
                out.append(bucket)
                bucket.add(item)
            else:
                _bucket_for(item, item.count * item.wire.itemsize, threshold, open_buckets, out).add(item)
        elif isinstance(item, list):
            by_key = {}
            for p in item:
                by_key.setdefault((p.wire, p.op, p.device, p.response.meta.postscale), []).append(p)
            for chunk in by_key.values():
                bucket = _bucket_for(chunk[0], sum(p.count for p in chunk) * chunk[0].wire.itemsize, threshold,
                                     open_buckets, out)
                for p in chunk:
                    bucket.add(p)
        else:
            out.append(item)
    return out


def _bucket_for(first: Piece, size: int, threshold: int, open_buckets: dict, out: list) -> Bucket:
    """The open bucket for ``first``'s kind if ``size`` more bytes fit, else a new one."""
    key = (first.wire, first.op, first.device, first.response.meta.postscale)
    bucket = open_buckets.get(key)
    if bucket is None or bucket.nbytes + size > threshold:
        bucket = open_buckets[key] = Bucket(first.wire, first.op, first.response.priority, first.device)
        out.append(bucket)
    return bucket


class Run:
    """A bucket of whole allreduce requests (one tensor each, or a group of one dtype): the requests and
    where each begins in the buffer (a group's tensors follow each other). ``grouped``: some request
    holds several tensors."""

    __slots__ = ("requests", "offsets", "count", "wire", "op", "postscale", "device", "contributors", "grouped",
                 "shape")

    def __init__(self, wire: np.dtype, op: int, postscale: float, device: str, contributors: int):
        self.shape: Optional[_RunShape] = None  # the remembered layout it was made from (``PlanCache``)
        self.requests: list = []
        self.offsets: List[int] = []
        self.count = 0  # elements
        self.wire = wire
        self.op = op
        self.postscale = postscale
        self.device = device
        self.contributors = contributors  # what Average divides by: the job's size
        self.grouped = False

    def add(self, request, count: int) -> None:
        self.requests.append(request)
        self.offsets.append(self.count)
        self.count += count
        if request is not None and not request.single:
            self.grouped = True

    @property
    def nbytes(self) -> int:
        return self.count * self.wire.itemsize

    def views(self, buf) -> list:
        """Each tensor's part of ``buf`` (one tensor per request). A run of a remembered layout keeps them
        for the next cycle that uses the same buffer: a step then unpacks with no slicing (measured, 1000
        tensors of 4 KiB: 0.25 -> 0.15 ms)."""
        shape = self.shape
        address = -1 if shape is None else data_ptr(buf)
        if shape is not None and shape.address == address:
            return shape.views
        ends = self.offsets[1:]
        ends.append(self.count)
        views = [buf[o:e] for o, e in zip(self.offsets, ends)]
        if shape is not None:
            # (the views keep the buffer alive, so no other buffer can begin at ``address`` meanwhile)
            shape.address, shape.views = address, views
        return views


def plan_cached(entries, requests, threshold: int, use_priority: bool, contributors: int) -> Optional[List[Run]]:
    """Buckets for tensors agreed through the response cache, straight from their cache entries
    (worked out once per name): no responses, pieces or queue. Exactly what scheduling then
    ``plan`` would make of them (most urgent first, ties in bit order, one open bucket per kind
    up to ``threshold``), or None when some tensor needs that general path (a group, a cast,
    a prescale)."""
    layout = _layout(entries, threshold, use_priority)
    return None if layout is None else _fill(layout, requests, contributors)


class _RunShape:
    """A run of a layout: what ``Run`` holds but its requests, and which of the agreed tensors it takes
    (``pick(requests)``: a slice of them, or an itemgetter of their positions)."""

    __slots__ = ("wire", "op", "postscale", "device", "offsets", "count", "pick", "positions", "address", "views")

    def __init__(self, wire, op, postscale, device):
        self.wire, self.op, self.postscale, self.device = wire, op, postscale, device
        self.offsets: List[int] = []
        self.count = 0
        self.positions: List[int] = []
        self.pick = None
        self.address = -1  # the fusion buffer that ``views`` (Run.views) are parts of
        self.views: list = []


def _layout(entries, threshold: int, use_priority: bool) -> Optional[List[_RunShape]]:
    """``plan_cached``'s buckets as positions in ``entries`` (None: some tensor needs the general path)."""
    for e in entries:
        if not e.whole:
            return None
    order = range(len(entries))
    if use_priority:
        prio = [e.priority for e in entries]
        if min(prio) != max(prio):
            order = sorted(order, key=lambda i: -prio[i])  # stable: ties keep bit order
    shapes: List[_RunShape] = []
    open_runs = {}
    for i in order:
        e = entries[i]
        key = e.fuse_key
        if key is None:  # a buffer that fuses tensors already: sent alone, where it lies
            meta = e.meta
            shape = _RunShape(dtype_from_name(meta.entries[0][0]), meta.op, meta.postscale, meta.device)
            shapes.append(shape)
        else:
            shape = open_runs.get(key)
            if shape is None or shape.count * key.wire.itemsize + e.nbytes > threshold:
                shape = open_runs[key] = _RunShape(key.wire, key.op, key.postscale, key.device)
                shapes.append(shape)
        shape.positions.append(i)
        shape.offsets.append(shape.count)
        shape.count += e.count
    for shape in shapes:
        positions = shape.positions
        first, last = positions[0], positions[-1]
        if positions == list(range(first, last + 1)):  # consecutive (the usual case): a slice
            shape.pick = operator.itemgetter(slice(first, last + 1))
        else:  # (two or more positions: itemgetter gives a tuple)
            shape.pick = operator.itemgetter(*positions)
    return shapes


_SINGLE = operator.attrgetter("single")


def _fill(layout: List[_RunShape], requests, contributors: int) -> List[Run]:
    """The runs of ``layout`` with this cycle's requests: work per run, not per tensor (but a check
    in C that none is a group)."""
    runs = []
    for shape in layout:
        run = _new(Run)
        run.requests = reqs = shape.pick(requests)
        run.offsets = shape.offsets  # (shared, read only)
        run.count = shape.count
        run.wire, run.op, run.postscale, run.device = shape.wire, shape.op, shape.postscale, shape.device
        run.contributors = contributors
        run.grouped = not all(map(_SINGLE, reqs))
        run.shape = shape
        runs.append(run)
    return runs


class PlanCache:
    """``plan_cached`` with a memory: the steady state of a training step agrees the same tensors in
    the same order cycle after cycle, so each such set's layout is worked out once and later cycles
    only put their requests into it (measured, 1000 tensors in one cycle: 0.18 ms -> ~0.03 ms). The
    key is the cache entries themselves: an entry never changes what bucketing reads of it (a new
    signature makes a new entry), so equal entries in equal order give equal buckets."""

    LIMIT = 16  # sets remembered (a step may agree its tensors in a few differently cut cycles)

    def __init__(self):
        self._layouts: dict = {}

    def runs(self, entries, requests, threshold: int, use_priority: bool, contributors: int) -> Optional[List[Run]]:
        key = (tuple(entries), threshold, use_priority)
        layout = self._layouts.get(key, False)
        if layout is False:
            layout = _layout(entries, threshold, use_priority)
            if len(self._layouts) >= self.LIMIT:
                self._layouts.clear()
            self._layouts[key] = layout
        return None if layout is None else _fill(layout, requests, contributors)


class FusionBuffers:
    """One reusable, aligned buffer per (device, wire dtype), grown on demand."""

    def __init__(self):
        self._buffers = {}

    def get(self, dtype: np.dtype, count: int, device: str = "cpu"):
        key = (device, dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.size < count:
            size = max(count, 1024, 0 if buf is None else buf.size * 2)
            buf = self._buffers[key] = empty((size,), dtype, device)
        return buf[:count]

    def clear(self) -> None:
        self._buffers.clear()


def scale_for(meta, op: int, contributors: int) -> float:
    """The factor applied after the reduction (postscale, and 1/n for Average); ``meta``: a signature, or
    anything else with its ``postscale`` (a ``Run``)."""
    s = float(meta.postscale)
    if op == _AVERAGE:
        s /= contributors
    return s


def pack(bucket: Bucket, buf, xp=np) -> None:
    """Copy every piece's input into ``buf`` (cast to the wire dtype, prescaled); ``xp``: numpy or cupy."""
    pieces = bucket.pieces
    if bucket.plain:
        if len(pieces) == 1:
            xp.copyto(buf, pieces[0].src)
        else:
            xp.concatenate([p.src for p in pieces], out=buf)
        return
    for p in pieces:
        dst = buf[p.offset:p.offset + p.count]
        if p.src is None:  # this rank joined: it contributes the identity of the op
            dst[...] = identity(p.op, dst.dtype)
            continue
        pre = p.response.meta.prescale
        if pre != 1.0:
            scale(p.src, pre, dst, xp)
        else:
            cast_copy(dst, p.src, xp)


def unpack(bucket: Bucket, buf, contributors: int, xp=np, scaled: bool = False) -> None:
    """Copy results out of ``buf`` into every piece's output, applying average and postscale (``scaled``: the
    transport applied them already, to a 16-bit sum before rounding it)."""
    op = bucket.op
    pieces = bucket.pieces
    if bucket.postscale is not None and bucket.plain and buf.dtype.kind in "fc":
        factor = bucket.postscale / contributors if op == _AVERAGE else bucket.postscale
        if factor != 1.0 and not scaled:
            _scale_result(buf, buf, op, factor, bucket.postscale, contributors, xp)
        for p in pieces:
            p.dst[...] = buf[p.offset:p.offset + p.count]
        return
    for p in pieces:
        if p.dst is None:
            name = p.response.name
            if xp is np and _SETUP.fullmatch(name):  # (SEEN_WHILE_JOINED)
                SEEN_WHILE_JOINED[name] = buf[p.offset:p.offset + p.count].copy()
            continue
        if scaled:
            cast_copy(p.dst, buf[p.offset:p.offset + p.count], xp)  # (decompressed, where the wire is narrower)
            continue
        meta = p.response.meta
        finish(p.dst, buf[p.offset:p.offset + p.count], op, scale_for(meta, op, contributors), meta.postscale,
               contributors, xp)


def identity(op: int, dtype: np.dtype):
    """The value that leaves ``op`` unchanged: what a rank that has joined contributes."""
    op = int(op)
    if op in (_AVERAGE, _SUM):
        return 0
    if op == _PRODUCT:
        return 1
    if op in _BITWISE:  # and: all bits set; or, xor: none
        return (True if dtype == np.bool_ else ~np.zeros((), dtype)[()]) if op == _BAND else 0
    if dtype == np.bool_:
        return op == _MIN  # and: True; or: False
    if dtype.kind == "f" or dtype.kind == "V":  # V: bfloat16 from ml_dtypes
        return np.inf if op == _MIN else -np.inf
    info = np.iinfo(dtype)
    return info.max if op == _MIN else info.min


def scale(src, factor: float, dst, xp=np) -> None:
    """``dst = src * factor``, cast to ``dst``'s dtype, as Horovod does (``ScaleBufferCPUImpl``, which its
    tests pin exactly): integers through float64 (then truncated), 16-bit floats through float32 (the
    factor itself is not rounded to 16 bits), float32 with the factor rounded to float32. On a CUDA
    device (``xp`` cupy) float16 is scaled by the factor rounded to float16, as Horovod's
    ``ScaleBufferCudaImpl`` does (``__float2half``, then a half-precision multiply)."""
    kind, size = src.dtype.kind, src.dtype.itemsize
    if (kind == "f" or kind == "V") and size < 4:
        f32 = np.float32(factor) if xp is np else np.float32(np.float16(factor))
        xp.multiply(src, f32, out=dst, dtype=np.float32, casting="unsafe")
    else:
        xp.multiply(src, factor, out=dst, casting="unsafe")


def _scale_result(dst, src, op: int, factor: float, postscale: float, contributors: int, xp) -> None:
    """``dst = src * factor`` after a reduction; a plain float Average (32 or 64 bits) divides by
    ``contributors`` instead (complex too: each part divided): the correctly rounded mean of the sum, as torch's ``sum / n`` and DDP's
    ``div_`` (a multiply by 1/n, rounded to float32, put 1/3 of a 3-rank average's elements 1 ulp off;
    within the tolerance of Horovod's tests, which compare averages approximately)."""
    if op == _AVERAGE and postscale == 1.0 and dst.dtype.kind in "fc" and dst.dtype.itemsize >= 4:
        xp.divide(src, contributors, out=dst, casting="unsafe")
    else:
        scale(src, factor, dst, xp)


def finish(dst, src, op: int, factor: float, postscale: float, contributors: int, xp=np) -> None:
    """``dst = src * factor`` (``src`` may be ``dst``). Integer Average divides by ``contributors``
    rounding toward zero, as C and Horovod do; with a ``postscale`` it is one factor, ``postscale /
    contributors``, truncated once (Horovod folds the average into the postscale: a sum of 3 on 2 ranks
    with postscale 2 is 3, not 1 * 2)."""
    if dst.dtype.kind in "iu" and op == _AVERAGE and postscale == 1.0:
        negative_rest = (src < 0) & (src % contributors != 0)  # floor division rounds these down
        xp.floor_divide(src, contributors, out=dst, casting="unsafe")
        dst += negative_rest
    elif factor != 1.0:
        if dst.dtype.kind == "f" and src.dtype != dst.dtype:
            cast_copy(dst, src, xp)  # decompress first, scale at full precision
            src = dst
        _scale_result(dst, src, op, factor, postscale, contributors, xp)
    elif dst is not src:
        cast_copy(dst, src, xp)


def cast_copy(dst, src, xp) -> None:
    """``dst[...] = src`` cast to ``dst``'s dtype: host arrays through ``compression.cast_into`` (the adapter's kernel
    or ``half.cast``, numpy's bits without its slow float16 loop), device arrays by their own module."""
    if xp is np:
        cast_into(dst, src)
    else:
        xp.copyto(dst, src, casting="unsafe")
