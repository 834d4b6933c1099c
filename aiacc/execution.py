"""Execution: what the scheduler sends this cycle, run on the transports.

Allreduces arrive grouped into buckets. A bucket is packed into a fusion
buffer (or reduced where it lies when it holds one tensor), reduced by one
collective, unpacked, and its handles completed. With a credit
(``AIACC_CREDIT_BYTES``) host buckets are posted non-blocking and land in a
later cycle (a :class:`Flight`): they fly while the engine negotiates.

Most buckets hold whole tensors (no partition, cast or prescale): they run as
a ``fusion.Run``, described by their requests and offsets alone, which the
engine makes straight from the cache entries of tensors agreed through the
response cache (every step of a training loop): no responses, pieces, queue
or planning. Such a bucket costs one concatenate, one collective, one
multiply, and per tensor a copy out (in place) or nothing at all (a new
result is a view of the reduced buffer)::

    new tensors:     responses ─► scheduler ─► fusion.plan ─► buckets ─► collectives
    cached tensors:  cache entries ─► fusion.plan_cached ─► runs ─► collectives

On one host, a run of several tensors that fits a slot of the host's shared window (``transport.shm``)
is packed into that slot and reduced there by the host's ranks, each its share, instead of by MPI.

Other collectives (broadcast, allgather, alltoall, reducescatter, barrier,
join) run one by one, blocking.
"""

from __future__ import annotations

import collections
import time
from typing import Callable, Optional

import numpy as np

from . import devices
from .adasum import adasum
from .exceptions import TensorMismatchError
from .fusion import Bucket, FusionBuffers, Run, cast_copy, finish, pack, scale, scale_for, unpack
from .half import cast
from .negotiation import Response
from .ops import Collective, ReduceOp, scatter_rows
from .requests import Request

__all__ = ["Executor", "Flight", "BufferPool"]

_data_ptr = devices.data_ptr


def _kept_apart(view, buf):
    """A new result, ``view`` of the fused buffer ``buf``: itself where it is at least half of it, else a copy, so
    that a result kept (a loss logged every step, fused with that step's gradients) keeps no more than twice its
    own size alive (a view of a 12 MB buffer per 4-byte loss: 1.2 GB after 100 steps)."""
    return view if 2 * view.size >= buf.size else view.copy()


class BufferPool:
    """Fusion buffers for allreduces in flight: each needs its own until it lands."""

    def __init__(self):
        self._free = collections.defaultdict(list)

    def take(self, dtype, count: int, device: str = devices.CPU):
        """A whole buffer of at least ``count`` elements (use ``[:count]`` of it)."""
        free = self._free[(device, dtype)]
        for i, buf in enumerate(free):
            if buf.size >= count:
                return free.pop(i)
        return devices.empty((max(count, 1024),), dtype, device)

    def give(self, buf, device: str = devices.CPU) -> None:
        self._free[(device, buf.dtype)].append(buf)

    def clear(self) -> None:
        self._free.clear()


class Flight:
    """A bucket's allreduce, posted (``request``) or finished (``request`` None)."""

    __slots__ = ("bucket", "request", "buf", "pooled", "fresh", "t0", "t1", "cycle", "scaled")

    def __init__(self, bucket, request, buf, pooled, fresh, t0, t1, cycle, scaled=False):
        """``scaled``: ``buf`` holds the final result (Average and postscale applied already)."""
        self.bucket, self.request, self.buf, self.pooled, self.fresh = bucket, request, buf, pooled, fresh
        self.t0, self.t1, self.cycle, self.scaled = t0, t1, cycle, scaled

    @property
    def nbytes(self) -> int:
        return self.bucket.nbytes


def _pack_run(run: Run, buf, xp) -> None:
    """Copy a run's tensors into ``buf``, one after the other: one concatenate."""
    reqs = run.requests
    if run.grouped:
        xp.concatenate([a for r in reqs for a in r.flat_inputs], out=buf)
    else:
        xp.concatenate([r.flat_inputs[0] for r in reqs], out=buf)


def _finish_run(run: Run, buf, xp) -> None:
    """Scale a run's reduced ``buf`` (or a share of it) in place: Average's 1/n and the postscale."""
    finish(buf, buf, run.op, scale_for(run, run.op, run.contributors), run.postscale, run.contributors, xp)


class Executor:
    """Runs buckets and collectives for one engine; called only from the engine thread.

    ``complete(request, result, error, t_done)`` finishes a handle (``complete_all(requests)``
    finishes allreduces with their outputs, without a timeline); ``transport_for(device)``
    gives the data transport of a device (MPI for host arrays, NCCL for CUDA arrays).
    """

    def __init__(self, rank: int, size: int, transport, transport_for: Callable, complete: Callable,
                 stats: collections.Counter, timeline=None, hierarchy=None, complete_all: Callable = None):
        self.rank = rank
        self.size = size
        self.transport = transport
        self.transport_for = transport_for
        self.complete = complete
        # finishes allreduce requests with their results, many at a time (no timeline)
        self.complete_all = complete_all or (lambda reqs: [complete(r, r.result(), None) for r in reqs])
        self.stats = stats
        self.timeline = timeline
        self.hierarchy = hierarchy  # (local_comm, cross_comm) for hierarchical allreduce, else None
        self.shared = None  # transport.shm.SharedAllreduce: fusion buffers of a one-host job (the engine sets it)
        self.buffers = FusionBuffers()
        self.pool = BufferPool()
        self.flights: collections.deque = collections.deque()
        self.cycle_no = 0

    # ---- execution -----------------------------------------------------------------------
    def run_all(self, runs, pipelined: bool) -> int:
        """Send buckets of whole tensors (``fusion.plan_cached``), in order."""
        sent = 0
        for run in runs:
            sent += self._send(run, pipelined and run.device == devices.CPU)
        return sent

    def execute(self, items, pipelined: bool) -> int:
        """Run what ``fusion.plan`` made of this cycle's items, in order.

        A tensor agreed while some rank had joined (its response says so, the same on every rank) has no
        request on that rank: there its bucket is pieces where the others' is a run, so such a bucket never
        goes through the shared window (a run would, and meet MPI's allreduce on the joined rank)."""
        sent = 0
        for item in items:
            if item.__class__ is Bucket:
                if item.whole:
                    bucket = self._run_of(item)
                    shared_ok = self.shared is not None and not any(p.response.joined for p in item.pieces)
                else:
                    bucket, shared_ok = item, False  # (pieces never go through the window)
                sent += self._send(bucket, pipelined and bucket.device == devices.CPU, shared_ok)
            else:
                sent += self._run_single(item)
        return sent

    def _run_of(self, bucket: Bucket) -> Run:
        run = Run(bucket.wire, bucket.op, bucket.postscale, bucket.device, self.size)
        for p in bucket.pieces:
            run.add(p.response.request, p.count)
        return run

    def _send(self, bucket, pipelined: bool, shared_ok: bool = True) -> int:
        if pipelined and self.hierarchy is None and not self.transport.multi_step(bucket.wire, bucket.op):
            self.flights.append(self._start(bucket, False, shared_ok))
        else:
            self._land(self._start(bucket, True, shared_ok))
        return bucket.nbytes

    def _start(self, bucket, blocking: bool, shared_ok: bool = True) -> Flight:
        """Pack a bucket and run its allreduce (``blocking``) or post it (else); ``shared_ok``: a run may
        go through the host's shared window."""
        t0 = time.perf_counter()
        device = bucket.device
        xp = devices.array_module(device)
        fresh = False
        pooled = None
        send = None
        if bucket.__class__ is Run:
            reqs = bucket.requests
            if len(reqs) == 1 and not bucket.grouped:
                # one tensor: reduce straight into its output, no fusion copy
                r = reqs[0]
                r.ensure_outputs()
                src, buf = r.flat_inputs[0], r.flat_outputs[0]
                if src is not buf and _data_ptr(src) != _data_ptr(buf):
                    send = src
            else:
                for r in reqs:
                    if r.outputs is None and r.allocate is not None:
                        r.ensure_outputs()  # the adapter's own memory (TensorFlow needs it aligned)
                    elif r.outputs is None:
                        fresh = True  # results become views of a buffer of their own: no copy out
                shared = self.shared if shared_ok else None
                if shared is not None and blocking and device == devices.CPU \
                        and shared.fits(bucket.wire, bucket.count, bucket.op):
                    return self._start_shared(bucket, shared, fresh, t0, xp)
                if fresh:
                    buf = devices.empty((bucket.count,), bucket.wire, device)
                elif blocking:
                    buf = self.buffers.get(bucket.wire, bucket.count, device)
                else:
                    pooled = self.pool.take(bucket.wire, bucket.count, device)
                    buf = pooled[:bucket.count]
                _pack_run(bucket, buf, xp)
        else:
            pieces = bucket.pieces
            if len(pieces) == 1 and bucket.plain:
                first = pieces[0]
                src, buf = first.src, first.dst
                if _data_ptr(src) != _data_ptr(buf):
                    send = src
            else:
                if blocking:
                    buf = self.buffers.get(bucket.wire, bucket.count, device)
                else:
                    pooled = self.pool.take(bucket.wire, bucket.count, device)
                    buf = pooled[:bucket.count]
                pack(bucket, buf, xp)
        t1 = time.perf_counter()
        transport = self.transport_for(device)
        op = ReduceOp(bucket.op)
        request = None
        factor = self._sum16_factor(device, bucket.wire, bucket.op, bucket,
                                    bucket.contributors if bucket.__class__ is Run else self.size)
        if factor is not None:  # (blocking: see _send; hierarchical by itself)
            self.transport.allreduce(send, buf, op, factor)
        elif self.hierarchy is not None:
            if send is not None:
                xp.copyto(buf, send)
            transport.allreduce_hierarchical(buf, op, *self.hierarchy)
        elif blocking:
            transport.allreduce(send, buf, op)
        else:
            request = transport.allreduce_start(send, buf, op)
        return Flight(bucket, request, buf, pooled, fresh, t0, t1, self.cycle_no, factor is not None)

    def _sum16_factor(self, device: str, wire, op: int, scaled, contributors: int) -> Optional[float]:
        """The factor of a 16-bit sum on the host (a bucket's, a reducescatter's; ``scaled``: what has the
        postscale), which the MPI transport applies to the float32 sums before it rounds them (Average's 1/n and
        the postscale: an average of float16 values is finite wherever it fits float16, not inf because the sum
        does not, as DDP's divide-first gives); None where the engine scales after the reduction: other dtypes
        and ops, device arrays (NCCL sums 16 bits natively), pieces with postscales of their own."""
        if device != devices.CPU or not self.transport.multi_step(wire, op) or scaled.postscale is None:
            return None
        return scale_for(scaled, op, contributors)

    def _start_shared(self, bucket: Run, shared, fresh: bool, t0: float, xp) -> Flight:
        """A bucket of several tensors through the host's shared window: packed into this rank's slot,
        reduced and scaled into the result slot, which it is unpacked from (``transport.shm``); new
        results (``fresh``) become views of one copy of it (the slot is reused by the next bucket)."""
        _pack_run(bucket, shared.slot(bucket.wire, bucket.count), xp)
        t1 = time.perf_counter()
        result = shared.reduce(bucket.wire, bucket.count, bucket.op, lambda share: _finish_run(bucket, share, xp))
        if fresh:
            result = result.copy()
        return Flight(bucket, None, result, None, fresh, t0, t1, self.cycle_no, True)

    def _land(self, flight: Flight) -> None:
        """A finished allreduce: unpack, scale, complete its handles."""
        bucket, buf = flight.bucket, flight.buf
        t2 = time.perf_counter()
        device = bucket.device
        xp = devices.array_module(device)
        if bucket.__class__ is Run:
            if not flight.scaled:
                _finish_run(bucket, buf, xp)
            reqs = bucket.requests
            if bucket.grouped:
                self._unpack_groups(reqs, bucket.offsets, buf, flight.fresh, xp)
            elif len(reqs) > 1:
                if flight.fresh:
                    for r, o in zip(reqs, bucket.offsets):
                        src = r.inputs[0]
                        view = buf[o:o + src.size]
                        if r.outputs is None:
                            r.outputs = [_kept_apart(view, buf).reshape(src.shape)]
                        else:
                            xp.copyto(r.flat_outputs[0], view)
                else:
                    # (item assignment, not xp.copyto: the same copy without a function dispatch per tensor)
                    for r, part in zip(reqs, bucket.views(buf)):
                        r.flat_outputs[0][...] = part
            n = len(reqs)
        else:
            pieces = bucket.pieces
            first = pieces[0]
            # Horovod's meaning: a rank that joined contributes the op's identity (zeros for a sum),
            # and an Average still divides by the job's size
            contributors = self.size
            if len(pieces) == 1 and bucket.plain:
                if not flight.scaled:
                    meta = first.response.meta
                    finish(buf, buf, bucket.op, scale_for(meta, bucket.op, contributors), meta.postscale,
                           contributors, xp)
            else:
                unpack(bucket, buf, contributors, xp, flight.scaled)
            n = len(pieces)
        if flight.pooled is not None:
            self.pool.give(flight.pooled, device)
        if device != devices.CPU:
            self.transport_for(device).synchronize()  # no handle completes before its result is final
        t3 = time.perf_counter()
        stats = self.stats
        stats["allreduces"] += 1  # collectives run (a bucket of tensors, a run, a partition)
        stats["bytes"] += bucket.nbytes
        stats["allreduce_seconds"] += t3 - flight.t0  # pack, reduce, unpack
        if bucket.__class__ is Run:
            stats["allreduce_requests"] += n
        timeline = self.timeline
        if timeline is not None:
            timeline.span_lane("buffers", f"allreduce x{n}", flight.t0, t3,
                          {"tensors": n, "bytes": bucket.nbytes, "dtype": bucket.wire.name})
        complete = self.complete
        if bucket.__class__ is Run:
            if timeline is None:
                self.complete_all(bucket.requests)
                return
            for r in bucket.requests:
                r.t_pack, r.t_comm, r.t_unpack = flight.t0, flight.t1, t2
                complete(r, r.result(), None, t3)
            return
        for piece in bucket.pieces:
            r = piece.response.request
            if r is None:
                continue
            if timeline is not None:
                if r.stamp("t_pack") is None:
                    r.t_pack, r.t_comm = flight.t0, flight.t1
                r.t_unpack = t2
            r.remaining -= 1
            if r.remaining == 0:
                stats["allreduce_requests"] += 1
                complete(r, r.result(), None, t3)

    @staticmethod
    def _unpack_groups(reqs, offsets, buf, fresh: bool, xp) -> None:
        """Results of a run that holds groups: each request's tensors follow each other from its offset;
        new results are views of ``buf`` when it is a buffer of their own (``fresh``)."""
        for r, o in zip(reqs, offsets):
            if fresh and r.outputs is None:
                outs = []
                for a in r.inputs:
                    outs.append(_kept_apart(buf[o:o + a.size], buf).reshape(a.shape))
                    o += a.size
                r.outputs = outs
                continue
            for out in r.flat_outputs:
                out[...] = buf[o:o + out.size]
                o += out.size

    def progress(self, wait_upto_cycle: int = -1) -> None:
        """Land the allreduces in flight that have finished; wait for those posted by cycle
        ``wait_upto_cycle`` or earlier."""
        if not self.flights:
            return
        still = collections.deque()
        transport = self.transport
        for flight in self.flights:
            if flight.cycle <= wait_upto_cycle:
                transport.wait_data(flight.request, flight.nbytes)
                self._land(flight)
            elif transport.test(flight.request):
                self._land(flight)
            else:
                still.append(flight)
        self.flights = still

    def flight_cycles(self) -> int:
        """How many posting cycles of this rank are still in flight."""
        return len({f.cycle for f in self.flights})

    def pause(self, seconds: float, wake, lock) -> None:
        """Sleep between cycles (until ``wake`` is set); with allreduces in flight, keep MPI
        progressing and land them (holding ``lock``, the engine's cycle lock: a waiting thread may
        run cycles meanwhile)."""
        if not self.flights:
            wake.wait(seconds)
            return
        deadline = time.perf_counter() + seconds
        nap = 1e-4
        while self.flights and not wake.is_set():
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            time.sleep(min(nap, left))
            with lock:
                self.progress()
        left = deadline - time.perf_counter()
        if left > 0 and not self.flights:
            wake.wait(left)

    # ---- other collectives ------------------------------------------------------------------
    def _run_single(self, resp: Response) -> int:
        req = resp.request
        if resp.error is not None:
            if req is not None:
                self.complete(req, None, TensorMismatchError(resp.error))
            return 0
        kind = Collective(resp.meta.kind)
        t0 = time.perf_counter()
        result = None
        nbytes = 0
        # counts and splits always travel over MPI; data over the tensor's own transport
        control = self.transport
        data = self.transport_for(resp.meta.device)
        xp = devices.array_module(resp.meta.device)
        if kind == Collective.BARRIER:
            control.barrier()
        elif kind == Collective.JOIN:
            result = resp.last_joined
        elif kind == Collective.BROADCAST:
            req.ensure_outputs()
            out = req.outputs[0]
            if self.rank == resp.meta.root and _data_ptr(out) != _data_ptr(req.inputs[0]):
                xp.copyto(out, req.inputs[0])
            data.broadcast(out, resp.meta.root)
            result, nbytes = out, out.nbytes
        elif kind == Collective.ALLGATHER:
            # every tensor's first dimension on every rank, in one exchange; then one gather each
            firsts = control.allgather_ints([a.shape[0] for a in req.inputs])
            outs = []
            for i, inp in enumerate(req.inputs):
                row = int(np.prod(inp.shape[1:], dtype=np.int64)) * inp.itemsize
                out = req.alloc_apart(i, (int(firsts[:, i].sum()),) + inp.shape[1:], inp.dtype)
                data.allgatherv(req.inputs[i], out, firsts[:, i] * row)
                outs.append(out)
                nbytes += out.nbytes
            result = outs[0] if req.single else outs
        elif kind == Collective.ALLTOALL:
            inp = req.inputs[0]
            row = int(np.prod(inp.shape[1:], dtype=np.int64)) * inp.itemsize
            recv_splits = control.alltoall_ints(req.splits)
            out = req.alloc_apart(0, (int(recv_splits.sum()),) + inp.shape[1:], inp.dtype)
            data.alltoallv(req.inputs[0], req.splits * row, out, recv_splits * row)
            result, nbytes = (out, recv_splits), out.nbytes
        elif kind == Collective.REDUCESCATTER:
            outs = [self._reducescatter(req, i, resp, data, xp) for i in range(len(req.inputs))]
            nbytes = sum(o.nbytes for o in outs)
            result = outs[0] if req.single else outs
        elif kind == Collective.ALLREDUCE:  # op=Adasum (the scheduler sends every other allreduce to a bucket)
            req.ensure_outputs()
            for i, inp in enumerate(req.inputs):
                self._adasum(inp, req.outputs[i], resp.meta, control, req.wires[i])
                nbytes += inp.nbytes
            result = req.outputs[0] if req.single else req.outputs
        else:  # pragma: no cover - allreduces go through buckets
            raise AssertionError(f"unexpected {kind}")
        if resp.meta.device != devices.CPU:
            data.synchronize()
        t1 = time.perf_counter()
        self.stats["adasum" if kind == Collective.ALLREDUCE else kind.name.lower()] += 1
        if req is not None:
            req.t_pack = req.t_comm = t0
            req.t_unpack = t1
            self.complete(req, result, None, t1)
        return nbytes

    def _adasum(self, inp, out, meta, control, wire) -> None:
        """``out`` = the Adasum of every rank's ``inp`` (``aiacc.adasum``), prescaled and postscaled; under
        compression the input is rounded to the ``wire`` dtype, travels in it, and so does the result."""
        narrow = wire != inp.dtype
        x = np.empty(inp.size, np.float64)  # (a copy: the input stays)
        if narrow:
            h = np.empty(inp.size, wire)  # x rounded to wire while ``rounded``
            cast(h, inp.reshape(-1))
            cast(x, h)
        else:
            cast(x, inp.reshape(-1))
        rounded = narrow
        if meta.prescale != 1.0:
            x *= meta.prescale
            rounded = False
        if self.size > 1:  # (a job of one rank: its tensor is the result; its transport exchanges nothing)
            if narrow:  # the result in wire (x: before its rounding, needed again only to be postscaled)
                h, rounded = adasum(x, self.rank, self.size, control.sendrecv, wire, h if rounded else None), True
                if meta.postscale != 1.0:
                    cast(x, h)
            else:
                adasum(x, self.rank, self.size, control.sendrecv)
        if meta.postscale != 1.0:
            x *= meta.postscale
            rounded = False
        if narrow and not rounded:
            cast(h, x)
        cast(out.reshape(-1), h if narrow else x)

    def _reducescatter(self, req: Request, index: int, resp: Response, data, xp):
        """Tensor ``index`` of ``req`` reduced across ranks; this rank keeps its block of rows (the
        first ``rows % size`` ranks one more). Cast to the wire dtype and back under compression."""
        meta = resp.meta
        op = ReduceOp(meta.op)
        rows = scatter_rows(req.inputs[index].shape[0], self.size)
        out = req.alloc_apart(index, (rows[self.rank],) + req.inputs[index].shape[1:], req.dtypes[index])
        inp = req.inputs[index]
        row_elems = int(np.prod(inp.shape[1:], dtype=np.int64))
        wire = req.wires[index]
        src = inp
        if meta.prescale != 1.0 or wire != inp.dtype:
            src = xp.empty(inp.shape, wire)
            if meta.prescale != 1.0:
                scale(inp, meta.prescale, src, xp)
            else:
                cast_copy(src, inp, xp)  # (compressed as a bucket's pack does)
        recv = out if wire == inp.dtype else xp.empty(out.shape, wire)
        counts = [n * row_elems for n in rows]
        factor = self._sum16_factor(meta.device, wire, op, meta, self.size)
        if factor is not None:  # scaled before the 16-bit rounding; then only decompressed
            data.reduce_scatter(src, recv, counts, op, factor)
            finish(out.reshape(-1), recv.reshape(-1), ReduceOp.SUM, 1.0, 1.0, self.size, xp)
        else:
            data.reduce_scatter(src, recv, counts, op)
            finish(out.reshape(-1), recv.reshape(-1), op, scale_for(meta, op, self.size), meta.postscale, self.size,
                   xp)
        return out

    def close(self) -> None:
        self.buffers.clear()
        self.pool.clear()
