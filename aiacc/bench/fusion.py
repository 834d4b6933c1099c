"""Many small tensors: the engine vs one raw call per tensor vs one raw call of all bytes.

    aiaccrun -np 2 python -m aiacc.bench fusion [--json]

1000 float32 tensors of 4 KiB each (by default) are reduced in place with Sum:
  * aiacc: 1000 ``submit`` calls (each returns at once), then a wait on every handle;
    the engine negotiates them (one bit each once cached) and fuses them into
    one buffer -- the whole path a training step's gradients take;
  * aiacc grouped: one ``grouped_allreduce`` of the same list (one name, one handle):
    what the engine costs when the per-tensor bookkeeping is paid once;
  * raw x N: N ``comm.Allreduce`` calls, one per tensor;
  * raw fused: one ``comm.Allreduce`` of the same total bytes (the lower bound).
Each figure is the median over repeats, the maximum over ranks.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from .. import api
from ..config import parse_bytes
from ..ops import Collective, Sum
from .common import add_output_args, emit, median

# the printed columns, also the report's table
COLUMNS = ["tensors", "bytes_each", "aiacc_ms", "raw_each_ms", "raw_fused_ms", "aiacc_vs_raw_fused",
           "aiacc_vs_raw_each", "grouped_ms", "grouped_vs_raw_fused"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m aiacc.bench fusion", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, default=1000)
    p.add_argument("--bytes", default="4KiB", help="size of each tensor")
    p.add_argument("--repeats", type=int, default=20)
    add_output_args(p)
    args = p.parse_args(argv)
    api.init()
    if api.get_engine() is None:
        raise SystemExit("run under aiaccrun (AIACC_ENABLE=1): the engine is disabled")
    from ..transport.mpi import import_mpi  # noqa: PLC0415

    MPI = import_mpi()
    comm = MPI.COMM_WORLD.Dup()
    each = parse_bytes(args.bytes) // 4
    tensors = [np.ones(each, np.float32) for _ in range(args.tensors)]
    names = [f"fusion.{i}" for i in range(args.tensors)]
    fused = np.ones(each * args.tensors, np.float32)

    def engine_step():
        handles = [api.submit(Collective.ALLREDUCE, t, name=nm, op=Sum, outputs=[t]) for t, nm in zip(tensors, names)]
        for h in handles:
            h.wait()

    def engine_grouped():
        api.submit(Collective.ALLREDUCE, tensors, name="fusion.grouped", op=Sum, outputs=tensors).wait()

    def raw_each():
        for t in tensors:
            comm.Allreduce(MPI.IN_PLACE, t)

    def raw_fused():
        comm.Allreduce(MPI.IN_PLACE, fused)

    engine_step()  # first step agrees on the names (slow path); later steps use the cache
    engine_grouped()
    times = {"aiacc": [], "aiacc_grouped": [], "raw_each": [], "raw_fused": []}
    for _ in range(args.repeats):
        for key, fn in (("raw_fused", raw_fused), ("raw_each", raw_each), ("aiacc", engine_step),
                        ("aiacc_grouped", engine_grouped)):
            comm.Barrier()
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    med = {k: comm.allreduce(median(v), op=MPI.MAX) for k, v in times.items()}
    rec = {
        "bench": "fusion", "ranks": api.size(), "tensors": args.tensors, "bytes_each": each * 4,
        "aiacc_ms": med["aiacc"] * 1e3, "raw_each_ms": med["raw_each"] * 1e3, "raw_fused_ms": med["raw_fused"] * 1e3,
        "aiacc_vs_raw_fused": med["aiacc"] / med["raw_fused"], "aiacc_vs_raw_each": med["aiacc"] / med["raw_each"],
        "grouped_ms": med["aiacc_grouped"] * 1e3, "grouped_vs_raw_fused": med["aiacc_grouped"] / med["raw_fused"],
    }
    if api.rank() == 0:
        emit([rec], args.json, COLUMNS)
    comm.Free()
    api.shutdown()
    return 0
