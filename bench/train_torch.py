"""``python -m aiacc.bench train --framework torch --model cnn|transformer`` (under ``aiaccrun -np N``).

Trains the shared benchmark models (``aiacc.bench.common.MODELS``) on synthetic data and prints
samples/s for aiacc's ``DistributedOptimizer`` (``aiacc``; ``aiacc+fwd`` with ``overlap_forward``:
each layer updated in its next forward, communication overlapping the next forward too) and for ``torch.nn.parallel.DistributedDataParallel``
(gloo) on the same model, ranks and batch, in the same processes: each repeat times aiacc, DDP, and
both without communication, one after the other, so machine noise hits all of them alike.

Step-time breakdown per row: ``compute ms`` is forward + backward + optimizer step with no
communication (a plain copy of the model for aiacc; ``DDP.no_sync()`` for DDP), ``step ms`` the full
data-parallel step, ``comm ms`` their difference: the communication time that overlap did not hide.
A measurement's time is the slowest rank's; the figure is the median over ``--repeats`` (the modes
take turns, in reverse order every other repeat), and ``vs ddp`` / ``vs ddp-tuned`` the ratio of
those medians' samples/s (``aiacc.bench.common.add_ratios``: one way for every ratio).

Rows (stable names, as in ``results.json``): ``aiacc`` (defaults), ``aiacc-tuned`` (the best
``bucket_cap_mb`` of ``--sweep-mb``), ``aiacc+fwd`` (``overlap_forward=True``), ``ddp`` (defaults)
and ``ddp-tuned`` (``gradient_as_bucket_view=True`` and the best ``bucket_cap_mb`` of the same sweep);
each row's ``settings`` says what it ran with. Where ``tools/build_horovod.sh`` has built Horovod
0.28.1 into the environment, a ``horovod`` row too (its defaults; its background thread runs only
while its own row is measured: ``horovod.init()`` before, ``horovod.shutdown()`` after).

CPU per step (rank 0, medians): ``engine cpu ms`` is the CPU time of aiacc's engine thread (for
DDP: the process CPU its steps take beyond the same steps under ``no_sync()``, i.e. its reducer and
gloo's threads); ``cycle cpu ms`` the CPU of every engine cycle, on whichever thread ran it (a training
thread waiting for a handle runs cycles itself, ``caller_cycles``: those are not in the engine thread's
clock; ``aiacc.summary()["cycle_cpu_seconds"]``; for DDP and Horovod rows the same figure as their
``engine cpu ms``); ``comm cpu ms`` that process-CPU difference for both; ``train stall ms`` how much
longer the training thread's forward + backward took in wall time than in its own CPU time, beyond
the same for the compute-only run -- the time it waited for the GIL or a core while communication
ran (a proxy: Python offers no direct measure of GIL waits).
"""

from __future__ import annotations

import argparse
import copy
import socket
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import aiacc.torch as hvd
from aiacc.bench.common import (MODELS, TRAIN_FIELDS, add_ratios, add_train_args, cycle_cpu, emit, engine_cpu,
                                free_port, median, positive_floats, positive_int)

__all__ = ["build_model", "synthetic_batch", "main", "fusion_cases"]


def fusion_cases(arrays, names):
    """The fusion bench's cases through aiacc.torch: the same arrays as torch tensors (shared memory),
    under the same names (so the response cache holds them once)."""
    tensors = [torch.from_numpy(a) for a in arrays]

    def each():
        handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=nm) for t, nm in zip(tensors, names)]
        for h in handles:
            hvd.synchronize(h)

    def grouped():
        hvd.grouped_allreduce_(tensors, op=hvd.Sum, name="fusion.grouped")

    return [("torch", each), ("torch_grouped", grouped)]


class _Transformer(nn.Module):
    def __init__(self, seq, vocab, d_model, heads, ff, layers, classes):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=ff, dropout=0.0, batch_first=True,
                                       norm_first=False) for _ in range(layers))
        self.head = nn.Linear(d_model, classes)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(dim=1))


def build_model(name: str) -> nn.Module:
    """The benchmark model ``name`` exactly as ``aiacc.bench.common`` defines it."""
    spec = MODELS[name]
    if name == "cnn":
        c1, c2, c3 = spec["channels"]
        side = spec["image"][1] // 4
        return nn.Sequential(
            nn.Conv2d(spec["image"][0], c1, 3, padding=1), nn.ReLU(),
            nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c2, c3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(c3 * side * side, spec["hidden"]), nn.ReLU(),
            nn.Linear(spec["hidden"], spec["classes"]))
    return _Transformer(**spec)


def synthetic_batch(name: str, batch: int, generator: torch.Generator):
    spec = MODELS[name]
    labels = torch.randint(0, spec["classes"], (batch,), generator=generator)
    if name == "cnn":
        return torch.randn(batch, *spec["image"], generator=generator), labels
    return torch.randint(0, spec["vocab"], (batch, spec["seq"]), generator=generator), labels


def _init_gloo() -> None:
    """torch.distributed on the same ranks, at an address and port agreed through aiacc."""
    if hvd.rank() == 0:
        host = "127.0.0.1" if hvd.local_size() == hvd.size() else socket.gethostbyname(socket.gethostname())
        where = (host, free_port())
    else:
        where = None
    host, port = hvd.broadcast_object(where, 0, name="bench.gloo.address")
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=hvd.rank(), world_size=hvd.size())


class _Clocks:
    """CPU and wall time of one mode's steps on this rank.

    ``engine``: CPU of aiacc's engine thread (``CLOCK_THREAD_CPUTIME_ID`` of that thread, read from
    the training thread). ``cycles``: CPU of every engine cycle, the engine thread's and those a waiting
    training thread ran (``aiacc.summary()["cycle_cpu_seconds"]``). ``process``: CPU of the whole
    process (every thread: for DDP its reducer in backward and gloo's threads). ``stall``: over forward + backward, the training thread's wall time
    minus its own CPU time -- time it wanted to run and did not (waiting for the GIL, or for a core);
    the proxy for what the engine's Python costs the training thread.
    """

    def __init__(self):
        self.engine = self.cycles = self.process = self.stall = 0.0

    def reset(self):
        self.engine = self.cycles = self.process = self.stall = 0.0


def _stepper(model, optimizer, batch, ddp_no_sync=None):
    x, y = batch
    loss_fn = nn.CrossEntropyLoss()
    clocks = _Clocks()

    def step():
        optimizer.zero_grad()
        w0, t0 = time.perf_counter(), time.thread_time()
        if ddp_no_sync is not None:
            with ddp_no_sync():
                loss_fn(model(x), y).backward()
        else:
            loss_fn(model(x), y).backward()
        clocks.stall += (time.perf_counter() - w0) - (time.thread_time() - t0)
        optimizer.step()

    # with overlap_forward the last step's updates are applied by the next forward: the timing
    # must include them, so a measurement ends with synchronize()
    step.finish = getattr(optimizer, "synchronize", None) if getattr(optimizer, "_aiacc_sched", None) else None
    step.clocks = clocks
    return step


def _measure(step, warmup: int, steps: int) -> float:
    """Seconds for ``steps`` steps on the slowest rank (and this rank's clocks, per step)."""
    for _ in range(warmup):
        step()
    if step.finish:
        step.finish()
    hvd.barrier()
    step.clocks.reset()
    engine0, cycles0, process0 = engine_cpu(), cycle_cpu(), time.process_time()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if step.finish:
        step.finish()
    mine = time.perf_counter() - start
    clocks = step.clocks
    clocks.engine, clocks.process = (engine_cpu() - engine0) / steps, (time.process_time() - process0) / steps
    clocks.cycles = (cycle_cpu() - cycles0) / steps
    clocks.stall /= steps
    return max(hvd.allgather_object(mine, name="bench.time"))


def _horovod():
    """horovod.torch if it is installed here (a benchmark baseline, never a dependency), else None."""
    import importlib.util  # noqa: PLC0415

    if importlib.util.find_spec("horovod") is None:
        return None
    import horovod.torch  # noqa: PLC0415

    return horovod.torch


def _sweep(candidates: dict, warmup: int, steps: int):
    """The candidate (name -> stepper) whose one measurement is fastest on the slowest rank."""
    timed = {name: _measure(step, warmup, steps) for name, step in candidates.items()}
    return min(timed, key=timed.get)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aiacc.bench train",
                                     description="samples/s of aiacc vs DistributedDataParallel (gloo)")
    add_train_args(parser)
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank")
    parser.add_argument("--horovod", choices=["auto", "off"], default="auto",
                        help="add a horovod row when horovod.torch imports (built by tools/build_horovod.sh)")
    parser.add_argument("--sweep-mb", type=positive_floats, default="1,5,25", metavar="MB,...",
                        help="bucket caps tried for the tuned rows (DDP's bucket_cap_mb and aiacc's alike)")
    args = parser.parse_args(argv)
    caps = args.sweep_mb
    hvd.init()
    torch.set_num_threads(args.threads)
    rank, size = hvd.rank(), hvd.size()
    _init_gloo()

    torch.manual_seed(0)
    reference = build_model(args.model)
    batch = synthetic_batch(args.model, args.batch_size, torch.Generator().manual_seed(rank))

    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def aiacc_mode(prefix: str, **kwargs):
        model = copy.deepcopy(reference)
        opt = hvd.DistributedOptimizer(sgd(model), named_parameters=[(f"{prefix}{k}", p) for k, p in
                                                                     model.named_parameters()], **kwargs)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        return _stepper(model, opt, batch)

    def ddp_mode(**kwargs):
        model = nn.parallel.DistributedDataParallel(copy.deepcopy(reference), **kwargs)
        return _stepper(model, sgd(model), batch)

    # The tuned rows: each implementation's best bucket cap of a small sweep, chosen here by one
    # measurement each; DDP tuned as its documentation advises (gradient_as_bucket_view=True).
    aiacc_cap = _sweep({c: aiacc_mode(f"sweep{c}.", bucket_cap_mb=c) for c in caps}, args.warmup, args.steps)
    ddp_cap = _sweep({c: ddp_mode(gradient_as_bucket_view=True, bucket_cap_mb=c) for c in caps},
                     args.warmup, args.steps)
    plain_model = copy.deepcopy(reference)
    ddp_model = nn.parallel.DistributedDataParallel(copy.deepcopy(reference))
    ddp_opt = sgd(ddp_model)
    modes = {
        "aiacc": aiacc_mode(""),  # defaults: what a user gets without tuning
        "aiacc-tuned": aiacc_mode("tuned.", bucket_cap_mb=aiacc_cap),
        # each layer updated in its next forward (ByteScheduler-style overlap; opt-in)
        "aiacc+fwd": aiacc_mode("fwd.", overlap_forward=True),
        "ddp": _stepper(ddp_model, ddp_opt, batch),
        "ddp-tuned": ddp_mode(gradient_as_bucket_view=True, bucket_cap_mb=ddp_cap),
        "aiacc compute": _stepper(plain_model, sgd(plain_model), batch),
        "ddp compute": _stepper(ddp_model, ddp_opt, batch, ddp_model.no_sync),
    }
    settings = {"aiacc": "defaults", "aiacc-tuned": f"bucket_cap_mb={aiacc_cap:g}",
                "aiacc+fwd": "overlap_forward=True", "ddp": "defaults",
                "ddp-tuned": f"gradient_as_bucket_view=True bucket_cap_mb={ddp_cap:g}"}
    horovod = _horovod() if args.horovod == "auto" else None
    if horovod is not None:  # Horovod 0.28.1 where tools/build_horovod.sh built it: its defaults
        horovod.init()
        model = copy.deepcopy(reference)
        opt = horovod.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
        horovod.broadcast_parameters(model.state_dict(), root_rank=0)
        horovod.shutdown()  # its background thread runs only while its own row is measured
        modes["horovod"] = _stepper(model, opt, batch)
        settings["horovod"] = "defaults (Horovod 0.28.1, MPI)"
    times = {mode: [] for mode in modes}
    cpu = {mode: {"engine": [], "cycles": [], "process": [], "stall": []} for mode in modes}
    for i in range(args.repeats):
        order = list(modes) if i % 2 == 0 else list(modes)[::-1]  # ABBA: drift hits every mode alike
        for mode in order:
            step = modes[mode]
            if mode == "horovod":
                horovod.init()
            times[mode].append(_measure(step, args.warmup, args.steps) / args.steps)
            if mode == "horovod":
                horovod.shutdown()
            for clock in ("engine", "cycles", "process", "stall"):
                cpu[mode][clock].append(getattr(step.clocks, clock))
    dist.destroy_process_group()
    cpu = {mode: {k: median(v) * 1e3 for k, v in clocks.items()} for mode, clocks in cpu.items()}

    params = sum(p.numel() for p in reference.parameters())
    records = []
    for name in settings:
        base = f"{'ddp' if name.startswith('ddp') else 'aiacc'} compute"  # (horovod: the plain model)
        step_s, compute_s = median(times[name]), median(times[base])
        comm_cpu = cpu[name]["process"] - cpu[base]["process"]
        records.append({
            "bench": "train", "framework": "torch", "model": args.model, "impl": name, "ranks": size,
            "batch": args.batch_size, "params": params, "tensors": len(list(reference.parameters())),
            "samples/s": size * args.batch_size / step_s, "per rank": args.batch_size / step_s,
            "step ms": step_s * 1e3, "compute ms": compute_s * 1e3, "comm ms": (step_s - compute_s) * 1e3,
            # CPU the communication costs per step: aiacc's engine thread; for DDP its reducer and gloo
            # (process CPU beyond the same steps under no_sync)
            "engine cpu ms": cpu[name]["engine"] if name.startswith("aiacc") else comm_cpu,
            "cycle cpu ms": cpu[name]["cycles"] if name.startswith("aiacc") else comm_cpu,
            "comm cpu ms": comm_cpu,
            "train stall ms": cpu[name]["stall"] - cpu[base]["stall"],
            "settings": settings[name],
        })
    add_ratios(records, "ddp")
    add_ratios(records, "ddp-tuned")
    if rank == 0:
        emit(records, args.json, TRAIN_FIELDS + ["vs ddp", "vs ddp-tuned", "engine cpu ms", "cycle cpu ms",
                                                 "comm cpu ms",
                                                 "train stall ms", "settings"])
    hvd.shutdown()
    return 0
