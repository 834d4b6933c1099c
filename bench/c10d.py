"""torch.distributed on the ``aiacc`` backend beside gloo, in the same job.

    aiaccrun -np 2 python -m aiacc.bench c10d [--models cnn,transformer,narrow] [--json]

(``aiacc.bench.c10d``; importing ``aiacc.torch`` registers the backend.)

The default process group is ``aiacc`` (``dist.init_process_group("aiacc")``, rendezvous from the variables
aiaccrun sets); a second group over the same ranks is gloo (``dist.new_group(backend="gloo")``), which is
what a CPU user of torch.distributed gets. Two parts, alternating the backends within each repeat (and which goes first, from one repeat to the
next):

* ``dist.all_reduce`` of float32, in place, Sum, synchronous: time per call and bus bandwidth
  (``bytes / time * 2 (n - 1) / n``), 4 KiB .. 16 MiB;
* DDP with default settings on each backend (the bench's models, ``--batch-size`` rows per rank, SGD):
  samples/s of all ranks together, median over ``--repeats`` measurements.

A table (one JSON record a row with ``--json``) whose rows are ``part=allreduce`` (``bytes``, ``aiacc_us``,
``gloo_us``, bus bandwidths, ``aiacc_vs_gloo``: a speed ratio, gloo time / aiacc time) and ``part=ddp``
(``model``, ``aiacc_sps``, ``gloo_sps``, ``aiacc_vs_gloo``).
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
import torch.distributed as dist

from aiacc.bench.common import MODELS, add_output_args, emit, float32_bytes, median, positive_int

import aiacc.torch  # noqa: F401  (registers the "aiacc" backend)

from .train_torch import build_model, synthetic_batch

COLUMNS = ["part", "bytes", "model", "aiacc_us", "gloo_us", "aiacc_busbw_GBps", "gloo_busbw_GBps", "aiacc_sps",
           "gloo_sps", "aiacc_vs_gloo"]


def _steps(model, opt, x, y, count: int) -> None:
    for _ in range(count):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _ddp_rates(model_name, groups, args, n: int) -> dict:
    """Median samples/s of DDP over each group. The DDP models die when this returns, while ``groups`` still
    holds the groups: a gloo group whose last owner is a DDP reducer is destroyed with the GIL held (torch's
    reducer keeps it; the group's own Python object lets it go), and its destructor joins gloo's worker
    threads, one of which may still be freeing the last work and waiting for the GIL: rank 2 of 3 hung there
    at exit, about one run in five."""
    gen = torch.Generator().manual_seed(dist.get_rank())
    x, y = synthetic_batch(model_name, args.batch_size, gen)
    ddps = {}
    for name, group in groups.items():
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(build_model(model_name), process_group=group)
        ddps[name] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    rates = {k: [] for k in groups}
    for rep in range(args.repeats):
        for name, (model, opt) in (list(ddps.items())[::-1] if rep % 2 else ddps.items()):  # ABBA order
            _steps(model, opt, x, y, 3)
            dist.barrier(group=groups[name])
            start = time.perf_counter()
            _steps(model, opt, x, y, args.steps)
            rates[name].append(args.steps * args.batch_size * n / (time.perf_counter() - start))
    return {k: median(v) for k, v in rates.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m aiacc.bench c10d", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="4KiB,64KiB,1MiB,16MiB")
    p.add_argument("--models", default="cnn,transformer,narrow")
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--steps", type=positive_int, default=15)
    p.add_argument("--repeats", type=positive_int, default=5)
    add_output_args(p)
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:  # (before anything runs: it was found after the allreduce part)
        p.error(f"--models: unknown model {unknown[0]!r}; choose from {', '.join(sorted(MODELS))}")
    try:
        sizes = [float32_bytes(s) for s in args.sizes.split(",") if s]
    except argparse.ArgumentTypeError as exc:
        p.error(f"--sizes {args.sizes!r}: {exc}")
    if not sizes:
        p.error(f"--sizes {args.sizes!r}: give at least one size")


    torch.set_num_threads(1)
    dist.init_process_group("aiacc")
    groups = {"aiacc": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    n = dist.get_world_size()
    records = []
    for size in sizes:
        x = torch.zeros(size // 4)  # summed in place over and over: ones would overflow to inf
        iters = max(5, min(2000, int(2e7 // max(size, 1))))
        times = {k: [] for k in groups}
        for rep in range(args.repeats):
            for name, group in (list(groups.items())[::-1] if rep % 2 else groups.items()):  # ABBA order
                for _ in range(3):
                    dist.all_reduce(x, group=group)
                dist.barrier(group=group)
                start = time.perf_counter()
                for _ in range(iters):
                    dist.all_reduce(x, group=group)
                times[name].append((time.perf_counter() - start) / iters)
        t = {k: median(v) for k, v in times.items()}
        bus = {k: size / v * 2 * (n - 1) / n / 1e9 for k, v in t.items()}
        records.append(dict(part="allreduce", bytes=size, aiacc_us=t["aiacc"] * 1e6, gloo_us=t["gloo"] * 1e6,
                            aiacc_busbw_GBps=bus["aiacc"], gloo_busbw_GBps=bus["gloo"],
                            aiacc_vs_gloo=t["gloo"] / t["aiacc"]))
    for model_name in models:
        r = _ddp_rates(model_name, groups, args, n)
        gc.collect()  # (DDP models held in reference cycles die now too, while groups holds the groups)
        records.append(dict(part="ddp", model=model_name, aiacc_sps=r["aiacc"], gloo_sps=r["gloo"],
                            aiacc_vs_gloo=r["aiacc"] / r["gloo"]))
    if dist.get_rank() == 0:
        emit(records, args.json, COLUMNS)
    dist.destroy_process_group()
    return 0
