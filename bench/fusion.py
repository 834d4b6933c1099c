"""Many small tensors: the engine vs one raw call per tensor vs one raw call of all bytes.

    aiaccrun -np 2 python -m aiacc.bench fusion [--json] [--torch]

1000 float32 tensors of 4 KiB each (by default) are reduced in place with Sum:
  * aiacc: 1000 named ``aiacc.allreduce_async_`` calls (each returns at once), then
    ``synchronize`` of every handle; the engine agrees on them (one bit each once
    cached) and fuses them into one buffer;
  * aiacc grouped: one ``aiacc.grouped_allreduce_`` of the same list (one name, one
    handle): what the engine costs when the per-tensor bookkeeping is paid once;
  * with ``--torch``, the same two through ``aiacc.torch`` on torch tensors that share
    the arrays' memory (``allreduce_async_`` + ``synchronize``, ``grouped_allreduce_``);
  * raw x N: N ``comm.Allreduce`` calls, one per tensor (in place);
  * raw fused: one ``comm.Allreduce`` of the same total bytes (the lower bound).
Each figure is the median over repeats, the maximum over ranks. The ratios ``*_vs_raw_*`` are times:
aiacc's time / raw time, below 1 when aiacc is faster (``allreduce``'s ``aiacc_vs_raw`` is the other way
round: a speed ratio, as its bandwidths).
"""

from __future__ import annotations

import argparse
import importlib
import time

import numpy as np

from .. import api
from ..ops import Sum
from .common import add_output_args, emit, float32_bytes, median, positive_int

# the printed columns, also the report's table
COLUMNS = ["tensors", "bytes_each", "aiacc_ms", "raw_each_ms", "raw_fused_ms", "aiacc_vs_raw_fused",
           "aiacc_vs_raw_each", "grouped_ms", "grouped_vs_raw_fused"]
TORCH_COLUMNS = ["torch_ms", "torch_vs_raw_each", "torch_grouped_ms", "torch_grouped_vs_raw_fused"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m aiacc.bench fusion", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=positive_int, default=1000)
    p.add_argument("--bytes", type=float32_bytes, default="4KiB", help="size of each tensor")
    p.add_argument("--repeats", type=positive_int, default=20)
    p.add_argument("--torch", action="store_true", help="also time the same calls through aiacc.torch")
    add_output_args(p)
    args = p.parse_args(argv)
    api.init()
    if api.get_engine() is None:
        raise SystemExit("run under aiaccrun (AIACC_ENABLE=1): the engine is disabled")
    from ..transport.mpi import import_mpi  # noqa: PLC0415

    MPI = import_mpi()
    comm = MPI.COMM_WORLD.Dup()
    each = args.bytes // 4
    # zeros: every case sums in place again and again; ones would grow by a factor of the ranks a call and
    # overflow to inf (numpy's overflow warning in the middle of the figures at 3 ranks)
    tensors = [np.zeros(each, np.float32) for _ in range(args.tensors)]
    names = [f"fusion.{i}" for i in range(args.tensors)]
    fused = np.zeros(each * args.tensors, np.float32)

    def engine_step():
        handles = [api.allreduce_async_(t, op=Sum, name=nm) for t, nm in zip(tensors, names)]
        for h in handles:
            api.synchronize(h)

    def engine_grouped():
        api.grouped_allreduce_(tensors, op=Sum, name="fusion.grouped")

    def raw_each():
        for t in tensors:
            comm.Allreduce(MPI.IN_PLACE, t)

    def raw_fused():
        comm.Allreduce(MPI.IN_PLACE, fused)

    cases = [("raw_fused", raw_fused), ("raw_each", raw_each), ("aiacc", engine_step), ("aiacc_grouped", engine_grouped)]
    if args.torch:
        # the framework is the adapter's business: imported only when asked for
        cases += importlib.import_module("aiacc.bench.train_torch").fusion_cases(tensors, names)
    for _, fn in cases[2:]:
        fn()  # the first call agrees on the names (slow path); later calls use the response cache
    times = {key: [] for key, _ in cases}
    for _ in range(args.repeats):
        for key, fn in cases:
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
    columns = COLUMNS
    if args.torch:
        rec.update({
            "torch_ms": med["torch"] * 1e3, "torch_vs_raw_each": med["torch"] / med["raw_each"],
            "torch_grouped_ms": med["torch_grouped"] * 1e3,
            "torch_grouped_vs_raw_fused": med["torch_grouped"] / med["raw_fused"],
        })
        columns = COLUMNS + TORCH_COLUMNS
    if api.rank() == 0:
        emit([rec], args.json, columns)
    comm.Free()
    api.shutdown()
    return 0
