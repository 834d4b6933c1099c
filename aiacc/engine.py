"""The engine: lifecycle, ``submit() -> Handle``, and the background thread.

One thread owns all communication. Each cycle (every ``cycle_time_ms``)::

    drain submissions ─► negotiate (one bitwise AND; gather only for new names)
          ─► schedule (priority queue, partitions, credit)
          ─► fuse into buckets ─► pack ─► collective ─► unpack ─► complete handles

The training thread only submits and waits; copies and MPI calls release the
GIL, so the training thread keeps computing while the engine communicates.

Errors never hang: a mismatch becomes the same error on every rank; a stall
is reported (and, if configured, ends every rank); an unexpected failure of
the engine thread, or an exception nobody caught on any rank, aborts the
whole MPI job with the message printed.
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
import time
from typing import Callable, List, Optional, Sequence

import numpy as np

from .compression import Compressor, as_compressor
from .config import Config
from .exceptions import AiaccError, DuplicateNameError, ShutdownError, StallError, TensorMismatchError
from .fusion import Bucket, FusionBuffers, finish, pack, plan, scale_for, unpack
from .negotiation import JOIN_NAME, Meta, Negotiator, Response
from .ops import Collective, ReduceOp, as_reduce_op
from .scheduler import Scheduler
from . import devices
from .tensors import check_array, dtype_name, maybe_output
from .timeline import Timeline
from .transport.mpi import MPITransport, import_mpi

logger = logging.getLogger("aiacc")

__all__ = ["Engine", "Handle", "Request"]

_FREE_FIRST_DIM = (Collective.ALLGATHER, Collective.ALLTOALL)
MAX_IDLE_SLEEP = 0.02  # seconds: the pause of an idle engine (a shutdown by another rank waits this long)

_allocate_lock = threading.Lock
_callbacks_lock = threading.Lock()


class Handle:
    """An operation in flight. ``wait()`` returns its result or raises its error."""

    __slots__ = ("name", "_lock", "_done", "_result", "_error", "_callbacks", "_wake")

    def __init__(self, name: str, wake: Optional[threading.Event] = None):
        self.name = name
        self._wake = wake
        self._lock = _allocate_lock()
        self._lock.acquire()
        self._done = False
        self._result = None
        self._error: Optional[BaseException] = None
        self._callbacks: Optional[list] = None

    def done(self) -> bool:
        """True once the result (or error) is available; never blocks."""
        return self._done

    def wait(self, timeout: Optional[float] = None):
        """Block until done; return the result or raise the operation's error."""
        if not self._done:
            waker = self._wake
            if waker is not None:
                waker.begin()  # someone waits: the engine cycles now instead of pausing or gathering
            try:
                if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
                    raise TimeoutError(f"operation on tensor {self.name!r} did not finish within {timeout} s")
                self._lock.release()
            finally:
                if waker is not None:
                    waker.end()
        if self._error is not None:
            raise self._error
        return self._result

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        """Call ``fn(handle)`` when done (at once if done already; else from the engine thread)."""
        with _callbacks_lock:
            if not self._done:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        fn(self)

    def _set(self, result, error: Optional[BaseException]) -> None:
        self._result = result
        self._error = error
        with _callbacks_lock:
            callbacks, self._callbacks = self._callbacks, None
            self._done = True
        self._lock.release()
        if callbacks:
            for fn in callbacks:
                try:
                    fn(self)
                except Exception:  # noqa: BLE001 - a callback must not kill the engine
                    logger.exception("aiacc: a completion callback of tensor %r failed", self.name)


class _Waker:
    """Tells the engine that someone is blocked on a handle: it then starts cycles at once
    (no pause, no gathering) for as long as anyone waits."""

    __slots__ = ("urgent", "wake", "waiters", "_lock")

    def __init__(self, urgent: threading.Event, wake: threading.Event):
        self.urgent, self.wake = urgent, wake
        self.waiters = 0
        self._lock = threading.Lock()

    def set(self) -> None:
        self.urgent.set()
        self.wake.set()

    def begin(self) -> None:
        with self._lock:
            self.waiters += 1
        self.set()

    def end(self) -> None:
        with self._lock:
            self.waiters -= 1


class Request(Handle):
    """One submitted operation on this rank; it is also the handle the caller waits on."""

    __slots__ = ("kind", "meta", "priority", "inputs", "flat_inputs", "outputs", "flat_outputs",
                 "dtypes", "splits", "allocate", "remaining", "t_submit", "t_seen", "t_agreed",
                 "t_pack", "t_comm", "t_unpack", "compression", "single", "wires")

    def __init__(self, name, kind, meta, priority, inputs, outputs, wake, splits, allocate, compression, single):
        Handle.__init__(self, name, wake)
        self.kind = kind
        self.meta = meta
        self.priority = priority
        self.inputs = inputs
        self.outputs = outputs
        self.single = single
        if len(inputs) == 1:
            a = inputs[0]
            self.flat_inputs = [a.reshape(-1)]
            self.dtypes = [a.dtype]
            if outputs is None:
                self.flat_outputs = None
            elif outputs[0] is a:
                self.flat_outputs = self.flat_inputs
            else:
                self.flat_outputs = [outputs[0].reshape(-1)]
        else:
            self.flat_inputs = [a.reshape(-1) for a in inputs]
            self.flat_outputs = None if outputs is None else [a.reshape(-1) for a in outputs]
            self.dtypes = [a.dtype for a in inputs]
        self.wires = self.dtypes if compression.name == "none" else [compression.wire_dtype(d) for d in self.dtypes]
        self.splits = splits
        self.allocate = allocate
        self.compression = compression
        self.remaining = 1
        self.t_submit = time.perf_counter()
        self.t_seen = self.t_agreed = self.t_pack = self.t_comm = self.t_unpack = None

    def alloc(self, shape, dtype):
        """A new output array: the adapter's allocator, else aligned host memory or device memory."""
        if self.allocate is not None:
            return self.allocate(shape, dtype)
        return devices.empty(shape, dtype, self.meta.device)

    def ensure_outputs(self) -> None:
        if self.outputs is None:
            self.outputs = [self.alloc(a.shape, a.dtype) for a in self.inputs]
            self.flat_outputs = [a.reshape(-1) for a in self.outputs]


_data_ptr = devices.data_ptr

# With a credit, allreduces posted in one cycle fly while later cycles negotiate. A rank can take
# more in flight while fewer than this many posting cycles of it are unfinished; all ranks post
# only when every rank can (a bit of the negotiation), so their collectives stay in the same order.
PIPELINE_DEPTH = 2


class _Flight:
    """A bucket's allreduce, posted (``request``) or finished (``request`` None)."""

    __slots__ = ("bucket", "request", "buf", "pooled", "t0", "t1", "cycle")

    def __init__(self, bucket, request, buf, pooled, t0, t1, cycle):
        self.bucket, self.request, self.buf, self.pooled = bucket, request, buf, pooled
        self.t0, self.t1, self.cycle = t0, t1, cycle


class _BufferPool:
    """Fusion buffers for allreduces in flight: each needs its own until it lands."""

    def __init__(self):
        self._free = collections.defaultdict(list)

    def take(self, dtype, count: int):
        """A whole buffer of at least ``count`` elements (use ``[:count]`` of it)."""
        free = self._free[dtype]
        for i, buf in enumerate(free):
            if buf.size >= count:
                return free.pop(i)
        return devices.empty((max(count, 1024),), dtype)

    def give(self, buf) -> None:
        self._free[buf.dtype].append(buf)


class Engine:
    """The communication engine of one process. Create through ``aiacc.init()``."""

    def __init__(self, config: Config, comm=None):
        MPI = import_mpi()
        self.config = config
        base = MPI.COMM_WORLD if comm is None else comm
        self.comm = base.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self._init_topology(MPI)
        self.transport = MPITransport(self.comm, on_slow_wait=self._on_slow_wait)
        self.negotiator = Negotiator(self.rank, self.size, self.transport, config.cache_capacity)
        self.scheduler = Scheduler(config.priority, config.partition_bytes, config.credit_bytes)
        self.buffers = FusionBuffers()
        self._pool = _BufferPool()
        self._flights: collections.deque = collections.deque()
        self._nccl = None
        self.fusion_threshold = config.fusion_threshold
        # Hierarchical allreduce pays off only with several hosts of several ranks each.
        self.hierarchical = config.hierarchical_allreduce and self.size > 1
        self.cycle_time = config.cycle_time_ms / 1000.0
        self.timeline: Optional[Timeline] = None
        if config.timeline and (self.rank == 0 or config.timeline_all_ranks):
            path = config.timeline if not config.timeline_all_ranks else f"{config.timeline}.rank{self.rank}"
            self.timeline = Timeline(path, self.rank)
        self.autotuner = None
        if config.autotune:
            from .autotune import Autotuner  # noqa: PLC0415

            self.autotuner = Autotuner(self, config)
        self._queue: collections.deque = collections.deque()
        self._wake = threading.Event()  # ends the pause between cycles
        self._urgent = threading.Event()  # someone waits for a handle: no gathering, cycle now
        self._waker = _Waker(self._urgent, self._wake)
        waker = self._waker
        self.transport.hurry = lambda: waker.waiters > 0
        self._idle = False  # set by the engine thread before an idle pause longer than a cycle
        self._inflight = set()
        self._lock = threading.Lock()
        self._noname = collections.Counter()
        self._shutdown_requested = False
        self._stopped = threading.Event()
        self._stop_error: Optional[AiaccError] = None
        self._next_stall_probe = time.monotonic() + 1.0
        self._last_stall_check = time.monotonic()
        self._stall_reported = set()
        self.stats = collections.Counter()
        self._thread = threading.Thread(target=self._run, name="aiacc-engine", daemon=True)
        self._thread.start()

    def _init_topology(self, MPI) -> None:
        per_host = self.config.hosts_per_node
        if per_host > 0:  # emulated hosts: consecutive ranks
            self.local_comm = self.comm.Split(self.rank // per_host, self.rank)
        else:
            self.local_comm = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = self.local_comm.Get_rank()
        self.local_size = self.local_comm.Get_size()
        self.cross_comm = self.comm.Split(self.local_rank, self.rank)
        self.cross_rank = self.cross_comm.Get_rank()
        self.cross_size = self.cross_comm.Get_size()

    # ---- submission (any thread) ---------------------------------------------------
    def submit(
        self,
        kind: Collective,
        arrays,
        *,
        name: Optional[str] = None,
        op=ReduceOp.AVERAGE,
        root: int = 0,
        prescale: float = 1.0,
        postscale: float = 1.0,
        compression=None,
        priority: float = 0.0,
        outputs: Optional[Sequence[np.ndarray]] = None,
        splits=None,
        allocate: Optional[Callable] = None,
    ) -> Handle:
        """Queue one operation; returns at once with a :class:`Handle`."""
        if kind.__class__ is not Collective:
            kind = Collective(kind)
        if name is None:
            with self._lock:
                self._noname[kind] += 1
                name = f"{kind}.noname.{self._noname[kind]}"
        elif name.__class__ is not str:
            raise TypeError(f"name must be a string, not {type(name).__name__}")
        if self._stop_error is not None or self._stopped.is_set():
            raise ShutdownError(f"cannot submit {kind} of tensor {name!r}: "
                                f"{self._stop_error or 'aiacc has been shut down'}")
        single = arrays.__class__ is not list and arrays.__class__ is not tuple
        arrays = [check_array(arrays, name)] if single else [check_array(a, name) for a in arrays]
        if outputs is not None:
            outputs = [maybe_output(o, a, name) for o, a in zip(outputs, arrays)]
        if op.__class__ is not ReduceOp:
            op = as_reduce_op(op)
        comp: Compressor = compression if isinstance(compression, Compressor) else as_compressor(compression)
        if kind is not Collective.ALLREDUCE:
            self._check_kind(kind, name, arrays, root)
            if kind is Collective.ALLTOALL:
                splits = self._check_splits(name, arrays[0], splits)
            entries = tuple((dtype_name(a.dtype), ((-1,) + a.shape[1:]) if kind in _FREE_FIRST_DIM else a.shape)
                            for a in arrays)
        elif single:
            entries = ((dtype_name(arrays[0].dtype), arrays[0].shape),)
        else:
            if not arrays:
                raise ValueError(f"allreduce of {name!r}: no tensors given")
            entries = tuple((dtype_name(a.dtype), a.shape) for a in arrays)
        # host arrays only: CPU (a grouped list is checked whole, a CUDA member among host ones is an error)
        host = single and arrays[0].__class__ is np.ndarray or all(a.__class__ is np.ndarray for a in arrays)
        device = devices.CPU if host else self._device_of(arrays, name)
        meta = Meta(int(kind), int(op), int(root) if kind is Collective.BROADCAST else 0, float(prescale),
                    float(postscale), comp.name, entries, device)
        req = Request(name, kind, meta, float(priority), arrays, outputs, self._waker, splits, allocate, comp, single)
        with self._lock:
            if name in self._inflight:
                raise DuplicateNameError(
                    f"tensor {name!r} was submitted on rank {self.rank} while an operation with the same name "
                    "is still in flight; names must be unique among outstanding operations")
            self._inflight.add(name)
        self._queue.append(req)
        if self._idle:  # the engine pauses longer than a cycle while idle: start the next cycle now
            self._wake.set()
        return req

    def _device_of(self, arrays, name: str) -> str:
        found = {devices.device_of(a) for a in arrays}
        if len(found) > 1:
            raise ValueError(f"grouped tensors {name!r} mix host and CUDA arrays; submit them separately")
        return found.pop() if found else devices.CPU

    def transport_for(self, device: str):
        """MPI for host arrays; NCCL (joined on first use, in the same cycle on every rank) for CUDA arrays."""
        if device == devices.CPU:
            return self.transport
        if self._nccl is None:
            from .transport.nccl import NCCLTransport  # noqa: PLC0415

            self._nccl = NCCLTransport(self.comm, self.local_rank, self.local_comm)
        return self._nccl

    def _check_kind(self, kind: Collective, name: str, arrays, root) -> None:
        if not arrays and kind not in (Collective.BARRIER, Collective.JOIN):
            raise ValueError(f"{kind} of {name!r}: no tensors given")
        if kind is Collective.BROADCAST and not 0 <= int(root) < self.size:
            raise ValueError(f"broadcast of tensor {name!r}: root_rank={root} is out of range "
                             f"for a job of {self.size} ranks (valid: 0..{self.size - 1})")
        if kind in (Collective.ALLGATHER, Collective.ALLTOALL, Collective.REDUCESCATTER):
            if len(arrays) != 1 or arrays[0].ndim == 0:
                raise ValueError(f"{kind} of tensor {name!r} needs one tensor with at least one dimension "
                                 f"(got shape {arrays[0].shape if arrays else None})")

    def _check_splits(self, name, array, splits):
        first = array.shape[0]
        if splits is None:
            if first % self.size:
                raise ValueError(f"alltoall of tensor {name!r}: first dimension {first} is not divisible by "
                                 f"{self.size} ranks; pass splits")
            return np.full(self.size, first // self.size, dtype=np.int64)
        splits = np.asarray(splits, dtype=np.int64).reshape(-1)
        if splits.size != self.size or (splits < 0).any() or splits.sum() != first:
            raise ValueError(f"alltoall of tensor {name!r}: splits {splits.tolist()} must be {self.size} "
                             f"non-negative numbers summing to the first dimension {first}")
        return splits

    # ---- lifecycle -------------------------------------------------------------------
    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Ask every rank to stop, wait for this rank's thread to end, free MPI resources."""
        self._shutdown_requested = True
        self._waker.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self._close_resources()

    def _close_resources(self) -> None:
        if self._thread.is_alive():
            return
        if self.timeline is not None:
            self.timeline.close()
        if self.autotuner is not None:
            self.autotuner.close()
        for c in (self.local_comm, self.cross_comm):
            try:
                c.Free()
            except Exception:  # noqa: BLE001
                pass
        self.local_comm = self.cross_comm = None
        self.transport.close()
        if self._nccl is not None:
            self._nccl.close()
        self.buffers.clear()

    @property
    def running(self) -> bool:
        return not self._stopped.is_set()

    # ---- the background thread ---------------------------------------------------------
    def _idle_sleep(self, idle: bool) -> float:
        """The pause before the next cycle: ``cycle_time``, or up to MAX_IDLE_SLEEP with nothing to do.

        An idle engine still takes part in one negotiation per cycle; at a 1 ms cycle that cost
        about a tenth of a core per rank (measured), taken from training on a machine with as
        many ranks as cores. So an engine with nothing left to agree on or to send after a cycle
        pauses longer, and submit() wakes it at once. That adds no latency: a
        tensor cannot be agreed before every rank has submitted it, each rank's submit wakes its
        own engine, and a rank that is waiting for the others keeps cycling (inside the
        negotiation's wait). Not while a rank has joined: it contributes without submitting, so
        the others would wait for its pauses.
        """
        if not idle:
            return self.cycle_time
        self._idle = True
        return max(self.cycle_time, MAX_IDLE_SLEEP)

    def _run(self) -> None:
        try:
            while True:
                start = time.perf_counter()
                self._drain()
                self._progress()
                want_stall = self._stall_check_due()
                may_send = len({f.cycle for f in self._flights}) < PIPELINE_DEPTH
                responses, shutdown, stall, send_ok = self.negotiator.cycle(self._shutdown_requested, want_stall,
                                                                             may_send)
                agreed = time.perf_counter()
                if responses:
                    if self.timeline is not None:
                        for r in responses:
                            if r.request is not None:
                                r.request.t_agreed = agreed
                    self.scheduler.push(responses)
                stopping = shutdown or (stall and self._stall_check(agreed))
                if stopping:
                    sent = self._execute(self.scheduler.take(everything=True))
                elif send_ok and len(self.scheduler):
                    sent = self._execute(self.scheduler.take())
                else:
                    sent = 0
                end = time.perf_counter()
                if self.timeline is not None and (responses or sent):
                    self.timeline.span("cycles", "cycle", start, end,
                                       {"agreed": len(responses), "bytes": sent})
                if self.autotuner is not None:
                    self.autotuner.on_cycle(responses)
                if stopping:
                    self._progress(self.negotiator.cycle_no)  # everything posted lands first
                    self._stop(shutdown)
                    return
                idle = not (self.negotiator.pending or len(self.scheduler) or self.negotiator.joined_ranks()
                            or self._flights)
                remaining = self._idle_sleep(idle) - (end - start)
                if remaining > 0 and not self._shutdown_requested and not (self._idle and self._queue):
                    self._pause(remaining)  # (otherwise the next cycle lands finished flights first thing)
                if self._idle and self._queue and not self._waker.waiters:
                    # A submit ended an idle pause: gather for one cycle time, so a burst of gradients
                    # is agreed and fused together (a waiter ends the gathering at once).
                    self._urgent.wait(self.cycle_time)
                self._idle = False
                self._wake.clear()
                self._urgent.clear()
                if self._waker.waiters:  # a waiter's signal cleared just now must not be lost
                    self._wake.set()
        except BaseException as exc:  # noqa: BLE001 - must never leave other ranks hanging
            self._fatal(exc)

    def _drain(self) -> None:
        q = self._queue
        add = self.negotiator.add
        now = time.perf_counter()
        while q:
            req = q.popleft()
            req.t_seen = now
            add(req)

    # ---- execution -----------------------------------------------------------------------
    def _execute(self, items) -> int:
        sent = 0
        for item in plan(items, self.fusion_threshold):
            if item.__class__ is Bucket:
                sent += self._run_bucket(item)
            else:
                sent += self._run_single(item)
        return sent

    def _run_bucket(self, bucket: Bucket) -> int:
        if self._pipelined(bucket):
            self._flights.append(self._start_bucket(bucket, blocking=False))
        else:
            self._land(self._start_bucket(bucket, blocking=True))
        return bucket.nbytes

    def _pipelined(self, bucket: Bucket) -> bool:
        """With a credit, host allreduces fly while the engine negotiates the next cycle (not on the
        hierarchical path, whose three steps use other communicators, nor over NCCL)."""
        return self.scheduler.credit_bytes > 0 and bucket.device == devices.CPU and not self.hierarchical

    def _start_bucket(self, bucket: Bucket, blocking: bool) -> "_Flight":
        """Pack a bucket and run its allreduce (``blocking``) or post it (else): a :class:`_Flight`."""
        t0 = time.perf_counter()
        pieces = bucket.pieces
        first = pieces[0]
        transport = self.transport_for(bucket.device)
        xp = devices.array_module(bucket.device)
        if len(pieces) == 1 and bucket.plain:
            # one tensor, nothing to cast or prescale: reduce straight into its output
            src, dst = first.src, first.dst
            same = _data_ptr(src) == _data_ptr(dst)
            buf, pooled = dst, None
            if self.hierarchical and not same:
                xp.copyto(dst, src)
        else:
            src = None
            same = True
            if blocking:
                pooled = None
                buf = self.buffers.get(bucket.wire, bucket.count, bucket.device)
            else:  # a buffer in flight must not be reused by the next bucket
                pooled = self._pool.take(bucket.wire, bucket.count)
                buf = pooled[:bucket.count]
            pack(bucket, buf, xp)
        t1 = time.perf_counter()
        request = None
        if self.hierarchical:
            transport.allreduce_hierarchical(buf, bucket.op, self.local_comm, self.cross_comm)
        elif blocking:
            transport.allreduce(None if same else src, buf, bucket.op)
        else:
            request = transport.allreduce_start(None if same else src, buf, bucket.op)
        return _Flight(bucket, request, buf, pooled, t0, t1, self.negotiator.cycle_no)

    def _land(self, flight: "_Flight") -> None:
        """A finished allreduce: unpack, scale, complete its handles."""
        bucket, buf = flight.bucket, flight.buf
        pieces = bucket.pieces
        first = pieces[0]
        t2 = time.perf_counter()
        contributors = self.size - len(first.response.joined)
        xp = devices.array_module(bucket.device)
        if len(pieces) == 1 and bucket.plain:
            meta = first.response.meta
            finish(buf, buf, bucket.op, scale_for(meta, bucket.op, contributors), meta.postscale, contributors, xp)
        else:
            unpack(bucket, buf, contributors, xp)
        if flight.pooled is not None:
            self._pool.give(flight.pooled)
        if bucket.device != devices.CPU:
            self.transport_for(bucket.device).synchronize()  # no handle completes before its result is final
        t3 = time.perf_counter()
        self.stats["buckets"] += 1
        self.stats["bytes"] += bucket.nbytes
        timeline = self.timeline
        if timeline is not None:
            timeline.span("buffers", f"allreduce x{len(pieces)}", flight.t0, t3,
                          {"tensors": len(pieces), "bytes": bucket.nbytes, "dtype": bucket.wire.name})
        for piece in pieces:
            r = piece.response.request
            if r is None:
                continue
            if timeline is not None:
                if r.t_pack is None:
                    r.t_pack, r.t_comm = flight.t0, flight.t1
                r.t_unpack = t2
            r.remaining -= 1
            if r.remaining == 0:
                self._complete(r, r.outputs[0] if r.single else r.outputs, None, t3)

    def _progress(self, wait_upto_cycle: int = -1) -> None:
        """Land the allreduces in flight that have finished; wait for those posted by cycle
        ``wait_upto_cycle`` or earlier."""
        if not self._flights:
            return
        still = collections.deque()
        for flight in self._flights:
            if flight.cycle <= wait_upto_cycle:
                self.transport.wait_data(flight.request, flight.bucket.nbytes)
                self._land(flight)
            elif self.transport.test(flight.request):
                self._land(flight)
            else:
                still.append(flight)
        self._flights = still

    def _pause(self, seconds: float) -> None:
        """Sleep between cycles; with allreduces in flight, keep MPI progressing (and land them)."""
        if not self._flights:
            self._wake.wait(seconds)
            return
        deadline = time.perf_counter() + seconds
        nap = 1e-4
        while self._flights and not self._wake.is_set():
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            time.sleep(min(nap, left))
            self._progress()
        left = deadline - time.perf_counter()
        if left > 0 and not self._flights:
            self._wake.wait(left)

    def _run_single(self, resp: Response) -> int:
        req = resp.request
        if resp.error is not None:
            if req is not None:
                self._complete(req, None, TensorMismatchError(resp.error))
            return 0
        kind = Collective(resp.meta.kind)
        t0 = time.perf_counter()
        result = None
        nbytes = 0
        # counts and splits always travel over MPI; data over the tensor's own transport
        data = self.transport_for(resp.meta.device)
        xp = devices.array_module(resp.meta.device)
        if kind == Collective.BARRIER:
            self.transport.barrier()
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
            inp = req.inputs[0]
            firsts = self.transport.allgather_ints([inp.shape[0]])[:, 0]
            row = int(np.prod(inp.shape[1:], dtype=np.int64)) * inp.itemsize
            out = req.alloc((int(firsts.sum()),) + inp.shape[1:], inp.dtype)
            data.allgatherv(inp, out, firsts * row)
            result, nbytes = out, out.nbytes
        elif kind == Collective.ALLTOALL:
            inp = req.inputs[0]
            row = int(np.prod(inp.shape[1:], dtype=np.int64)) * inp.itemsize
            recv_splits = self.transport.alltoall_ints(req.splits)
            out = req.alloc((int(recv_splits.sum()),) + inp.shape[1:], inp.dtype)
            data.alltoallv(inp, req.splits * row, out, recv_splits * row)
            result, nbytes = (out, recv_splits), out.nbytes
        elif kind == Collective.REDUCESCATTER:
            result, nbytes = self._reducescatter(req, resp, data, xp)
        else:  # pragma: no cover - allreduces go through buckets
            raise AssertionError(f"unexpected {kind}")
        if resp.meta.device != devices.CPU:
            data.synchronize()
        t1 = time.perf_counter()
        if req is not None:
            req.t_pack = req.t_comm = t0
            req.t_unpack = t1
            self._complete(req, result, None, t1)
        return nbytes

    def _reducescatter(self, req: Request, resp: Response, data, xp):
        inp = req.inputs[0]
        op = ReduceOp(resp.meta.op)
        first = inp.shape[0]
        base, extra = divmod(first, self.size)
        rows = [base + (1 if r < extra else 0) for r in range(self.size)]
        row_elems = int(np.prod(inp.shape[1:], dtype=np.int64))
        src = inp
        if resp.meta.prescale != 1.0:
            src = xp.multiply(inp, resp.meta.prescale, dtype=inp.dtype, casting="unsafe")
        out = req.alloc((rows[self.rank],) + inp.shape[1:], inp.dtype)
        data.reduce_scatter(src, out, [n * row_elems for n in rows], op)
        flat = out.reshape(-1)
        finish(flat, flat, op, scale_for(resp.meta, op, self.size), resp.meta.postscale, self.size, xp)
        return out, out.nbytes

    def _complete(self, req: Request, result, error: Optional[BaseException], t_done: Optional[float] = None) -> None:
        self._inflight.discard(req.name)  # atomic; submit's lock only guards its check-then-add
        if self.timeline is not None and error is None:
            t_done = t_done or time.perf_counter()
            self.timeline.tensor(req.name, (
                ("queued", req.t_submit, req.t_seen),
                ("negotiate", req.t_seen, req.t_agreed),
                ("pack", req.t_pack, req.t_comm),
                ("communicate", req.t_comm, req.t_unpack),
                ("unpack", req.t_unpack, t_done),
            ), {"op": str(Collective(req.kind)), "bytes": int(sum(a.nbytes for a in req.inputs))})
        req._set(result, error)

    # ---- stalls -------------------------------------------------------------------------
    def _stall_limits(self):
        limits = [s for s in (self.config.stall_check_seconds, self.config.stall_shutdown_seconds) if s > 0]
        return min(limits) if limits else 0.0

    def _stall_check_due(self) -> bool:
        limit = self._stall_limits()
        if not limit:
            return False
        now = time.monotonic()
        if now < self._next_stall_probe:
            return False
        self._next_stall_probe = now + min(1.0, limit / 2)
        if now - self._last_stall_check < limit:
            return False
        pending = self.negotiator.pending
        if not pending:
            return False
        oldest = min(r.t_submit for r in pending.values())
        return time.perf_counter() - oldest >= limit

    def _stall_check(self, now: float) -> bool:
        """Collective stall report. Returns True when every rank must stop."""
        self._last_stall_check = time.monotonic()
        report = self.negotiator.stall_report(now)
        check, stop_after = self.config.stall_check_seconds, self.config.stall_shutdown_seconds
        stalled = [item for item in report if item[3] >= self._stall_limits()]
        if not stalled:
            return False
        fatal = stop_after > 0 and any(age >= stop_after for *_, age in stalled)
        if fatal:
            # The job ends here: name every tensor some rank is still waiting for, also those
            # submitted after the oldest one (a rank that waits on a younger tensor is as stuck).
            stalled = report
        lines = [f"tensor {name!r}: submitted {age:.1f} s ago by ranks {have}, "
                 f"still missing on ranks {missing}" for name, have, missing, age in stalled[:20]]
        if len(stalled) > 20:
            lines.append(f"... and {len(stalled) - 20} more tensors")
        text = "\n  ".join(lines)
        if fatal:
            self._stop_error = StallError(
                f"aiacc stopped after a stall of more than {stop_after:g} s "
                f"(AIACC_STALL_SHUTDOWN_SECONDS); some ranks never submitted these tensors:\n  {text}")
            if self.rank == 0:
                logger.error("%s", self._stop_error)
            return True
        if self.rank == 0:
            logger.warning("aiacc stall: some ranks have not submitted tensors the others are waiting for "
                           "(one rank may be behind, or ranks run different code paths):\n  %s", text)
        return False

    def _on_slow_wait(self, waited: float) -> None:
        """Called while this engine waits long for the other ranks' engines in negotiation."""
        limit = self.config.stall_shutdown_seconds
        logger.warning("aiacc rank %d: the engine has waited %.0f s for the other ranks' engines; a rank may be "
                       "stuck outside aiacc (for example holding the GIL in a long call)", self.rank, waited)
        if limit > 0 and waited >= limit:
            logger.error("aiacc rank %d: no answer from the other ranks for %.0f s "
                         "(AIACC_STALL_SHUTDOWN_SECONDS=%g); aborting the job", self.rank, waited, limit)
            _flush_std()
            self.transport.abort(1)

    # ---- stopping ----------------------------------------------------------------------
    def _stop(self, shutdown_agreed: bool) -> None:
        if self._stop_error is None and shutdown_agreed:
            who = self.transport.allgather_object(self._shutdown_requested)
            ranks = [r for r, asked in enumerate(who) if asked]
            self._stop_error = ShutdownError(
                f"aiacc was shut down by rank{'s' if len(ranks) > 1 else ''} "
                f"{','.join(map(str, ranks))} (shutdown() or the end of the script)")
        self._stopped.set()
        leftovers = self.negotiator.take_all()
        while self._queue:
            leftovers.append(self._queue.popleft())
        for req in leftovers:
            err = self._stop_error
            if isinstance(err, ShutdownError):
                err = ShutdownError(f"{req.kind} of tensor {req.name!r} on rank {self.rank} did not complete: {err}")
            self._complete(req, None, err)

    def _fatal(self, exc: BaseException) -> None:
        self._stop_error = AiaccError(f"aiacc engine on rank {self.rank} failed: {exc!r}")
        logger.critical("aiacc: the engine thread on rank %d failed; ending the job", self.rank, exc_info=exc)
        self._stopped.set()
        try:
            for req in self.negotiator.take_all() + list(self._queue):
                req._set(None, self._stop_error)
        finally:
            if self.size > 1:
                _flush_std()
                self.transport.abort(1)


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
