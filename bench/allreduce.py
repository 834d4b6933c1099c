"""Engine allreduce bus bandwidth beside raw mpi4py ``Allreduce``, measured in the same run.

    aiaccrun -np 2 python -m aiacc.bench allreduce [--json]

Both sides reduce float32 arrays in place with Sum (how adapters reduce
gradients): raw is ``comm.Allreduce(MPI.IN_PLACE, x)`` on a duplicate of
COMM_WORLD; the engine is ``aiacc.allreduce_(x, op=Sum, name=...)`` (in place),
which includes negotiation, scheduling and completion. Bus bandwidth follows
nccl-tests: ``bytes / time * 2 (n - 1) / n``. Sizes alternate raw / engine
and each figure is the median over repeats. ``aiacc_vs_raw`` = raw time / aiacc's time (a speed ratio,
as the bandwidths): above 1 when aiacc is faster (``fusion``'s ratios are times, the other way round).

``--device cuda`` measures CUDA arrays (cupy, ``pip install 'aiacc[gpu]'``) instead: raw is cupy's NCCL
``allReduce`` in place on a communicator of its own, followed by a stream synchronize (what the
engine's handle waits for before it completes); the engine reduces the same array over its NCCL
transport. On one rank the bus bandwidth factor 2(n-1)/n is 0, so the bandwidth columns then show
bytes / time (the algorithm bandwidth) instead.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from .. import api
from ..ops import Sum
from .common import add_output_args, at_least, emit, float32_bytes, median, positive_float, positive_int

# the printed columns, also the report's table
COLUMNS = ["bytes", "raw_us", "aiacc_us", "raw_busbw_GBps", "aiacc_busbw_GBps", "aiacc_vs_raw"]


def _time(fn, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def _raw(device: str, comm, MPI):
    """(in-place raw allreduce of one array, array module) for ``device``."""
    if device == "cpu":
        return (lambda x: comm.Allreduce(MPI.IN_PLACE, x)), np
    from ..transport.nccl import cupy_or_none  # noqa: PLC0415

    cupy = cupy_or_none()
    if cupy is None:
        raise SystemExit("--device cuda: cupy with a usable CUDA device is needed (pip install 'aiacc[gpu]')")
    from cupy.cuda import nccl  # noqa: PLC0415

    cupy.cuda.Device(api.local_rank() % cupy.cuda.runtime.getDeviceCount()).use()
    uid = comm.bcast(nccl.get_unique_id() if comm.Get_rank() == 0 else None, root=0)
    ncomm = nccl.NcclCommunicator(comm.Get_size(), uid, comm.Get_rank())
    stream = cupy.cuda.Stream.null

    def raw(x):
        ncomm.allReduce(x.data.ptr, x.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
        stream.synchronize()

    return raw, cupy


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m aiacc.bench allreduce", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-bytes", type=float32_bytes, default="4KiB")
    p.add_argument("--max-bytes", type=float32_bytes, default="64MiB")
    p.add_argument("--factor", type=at_least(2), default=4, help="size step (>= 2)")
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--target-seconds", type=positive_float, default=0.05, help="time per measurement")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the arrays live: host memory over MPI, or CUDA memory over NCCL")
    add_output_args(p)
    args = p.parse_args(argv)
    if args.min_bytes > args.max_bytes:
        p.error(f"--min-bytes ({args.min_bytes} bytes) is above --max-bytes ({args.max_bytes} bytes)")
    api.init()
    engine = api.get_engine()
    if engine is None:
        raise SystemExit("run under aiaccrun (AIACC_ENABLE=1): the engine is disabled")
    from ..transport.mpi import import_mpi  # noqa: PLC0415

    MPI = import_mpi()
    comm = MPI.COMM_WORLD.Dup()
    n = api.size()
    factor = 2 * (n - 1) / n if n > 1 else 1.0
    raw_allreduce, xp = _raw(args.device, comm, MPI)
    size, max_bytes = args.min_bytes, args.max_bytes
    records = []
    while size <= max_bytes:
        x = xp.zeros(size // 4, xp.float32)  # summed in place over and over: ones would overflow to inf
        # agree on an iteration count from a raw probe (rank 0's choice for everyone); the probe runs
        # long enough that a token bucket's burst on an emulated link cannot fool it
        probe_iters, probe = 1, 0.0
        while True:
            probe = _time(lambda: raw_allreduce(x), probe_iters)
            if comm.allreduce(probe * probe_iters, op=MPI.MAX) >= 0.02 or probe_iters >= 1024:
                break
            probe_iters *= 2
        iters = int(comm.bcast(max(3, min(2000, int(args.target_seconds / max(probe, 1e-7)))), root=0))
        name = f"bench.{size}"

        def engine_once():
            api.allreduce_(x, op=Sum, name=name)

        engine_once()  # agree once; later calls hit the response cache
        raw_t, eng_t = [], []
        for _ in range(args.repeats):
            comm.Barrier()
            raw_t.append(_time(lambda: raw_allreduce(x), iters))
            comm.Barrier()
            eng_t.append(_time(engine_once, iters))
        # every rank reports rank 0's view of time: take the max over ranks of each median
        raw_med = comm.allreduce(median(raw_t), op=MPI.MAX)
        eng_med = comm.allreduce(median(eng_t), op=MPI.MAX)
        records.append({
            "bench": "allreduce", "ranks": n, "bytes": size, "device": args.device,
            "raw_us": raw_med * 1e6, "aiacc_us": eng_med * 1e6,
            "raw_busbw_GBps": size / raw_med * factor / 1e9, "aiacc_busbw_GBps": size / eng_med * factor / 1e9,
            "aiacc_vs_raw": raw_med / eng_med,
        })
        size *= args.factor
    if api.rank() == 0:
        emit(records, args.json, COLUMNS)
    comm.Free()
    api.shutdown()
    return 0
