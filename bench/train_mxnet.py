"""``python -m aiacc.bench train --framework mxnet``: samples/s of Gluon training, run under aiaccrun.

    OMP_NUM_THREADS=1 MXNET_CPU_WORKER_NTHREADS=1 \\
        aiaccrun -np 2 python -m aiacc.bench train --framework mxnet --model cnn

The models are those of :mod:`aiacc.bench.common` (``cnn``, ``transformer``, ``narrow``),
built with Gluon and hybridized; SGD with momentum; synthetic data; the same
per-rank batch in every mode. Each of ``--repeats`` rounds measures every mode
once (interleaved, so a change of machine load hits all modes alike); the
median is reported:

``compute``           every rank trains alone (``gluon.Trainer``, no communication) while aiacc's
                      engine is shut down: the ceiling.
``aiacc``             ``DistributedTrainer``: each gradient bucket is submitted as soon as MXNet
                      has finished its gradients, so communication overlaps the rest of backward.
``aiacc-no-overlap``  the same trainer after ``mx.nd.waitall()``: every bucket is submitted
                      only once the whole backward pass is done.
``ps-dist_sync``      ``gluon.Trainer(kvstore='dist_sync')``: MXNet's own parameter server
                      (ps-lite; the optimizer runs on the server). While aiacc is shut down, rank 0
                      starts a scheduler, a server and one worker per rank on 127.0.0.1 and the
                      other ranks wait without spinning (``--kvstore off`` skips it).

samples/s counts all ranks (steps x batch x ranks / the slowest rank's time). On a busy
machine wall time swings with other load; ``cpu ms/step/rank`` (CPU time of the rank's
process, all threads) shows what each mode costs regardless.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

import aiacc.mxnet as hvd  # first: it restores numpy.bool, which MXNet 1.9.1 needs at import
import mxnet as mx
from mxnet import autograd, gluon, nd

from aiacc.bench.common import MODELS, TRAIN_FIELDS, add_ratios, add_train_args, emit, free_port, median, positive_float

__all__ = ["main", "build_model"]

MODES = ("compute", "aiacc", "aiacc-no-overlap")
PS = "ps-dist_sync"  # MXNet's dist_sync kvstore: a parameter server, the baseline MXNet itself offers
SETTINGS = {"aiacc": "defaults", "aiacc-no-overlap": "mx.nd.waitall() before step()",
            PS: "parameter server (ps-lite): 1 server, 1 worker per rank, optimizer on the server"}


# ---- models (aiacc.bench.common.MODELS) --------------------------------------------------------
class _EncoderLayer(gluon.HybridBlock):
    """Post-norm transformer encoder layer; attention from Dense layers and batch_dot."""

    def __init__(self, d_model, heads, ff, **kwargs):
        super().__init__(**kwargs)
        self._heads = heads
        self._scale = 1.0 / float(np.sqrt(d_model // heads))
        with self.name_scope():
            self.qkv = gluon.nn.Dense(3 * d_model, flatten=False, in_units=d_model)
            self.proj = gluon.nn.Dense(d_model, flatten=False, in_units=d_model)
            self.norm1 = gluon.nn.LayerNorm(in_channels=d_model)
            self.ff1 = gluon.nn.Dense(ff, flatten=False, activation="relu", in_units=d_model)
            self.ff2 = gluon.nn.Dense(d_model, flatten=False, in_units=ff)
            self.norm2 = gluon.nn.LayerNorm(in_channels=d_model)

    def _split_heads(self, F, x):  # (B, T, H*D) -> (B*H, T, D)
        x = F.reshape(x, shape=(0, 0, self._heads, -1))
        return F.reshape(F.transpose(x, axes=(0, 2, 1, 3)), shape=(-3, 0, 0))

    def hybrid_forward(self, F, x):
        q, k, v = F.split(self.qkv(x), num_outputs=3, axis=-1)
        q, k, v = (self._split_heads(F, t) for t in (q, k, v))
        att = F.softmax(F.batch_dot(q, k, transpose_b=True) * self._scale, axis=-1)
        ctx = F.reshape(F.batch_dot(att, v), shape=(-4, -1, self._heads, 0, 0))  # (B, H, T, D)
        ctx = F.reshape(F.transpose(ctx, axes=(0, 2, 1, 3)), shape=(0, 0, -3))  # (B, T, H*D)
        x = self.norm1(x + self.proj(ctx))
        return self.norm2(x + self.ff2(self.ff1(x)))


class _Transformer(gluon.HybridBlock):
    def __init__(self, seq, vocab, d_model, heads, ff, layers, classes, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.embed = gluon.nn.Embedding(vocab, d_model)
            self.encoder = gluon.nn.HybridSequential()
            for _ in range(layers):
                self.encoder.add(_EncoderLayer(d_model, heads, ff))
            self.head = gluon.nn.Dense(classes, in_units=d_model)

    def hybrid_forward(self, F, tokens):
        return self.head(F.mean(self.encoder(self.embed(tokens)), axis=1))


def build_model(name: str):
    """(net, input shape, input maker) for a model of aiacc.bench.common.MODELS."""
    spec = MODELS[name]
    if name == "cnn":
        c1, c2, c3 = spec["channels"]
        size = spec["image"][1] // 4
        net = gluon.nn.HybridSequential(prefix="cnn_")
        with net.name_scope():
            net.add(gluon.nn.Conv2D(c1, 3, padding=1, activation="relu", in_channels=spec["image"][0]),
                    gluon.nn.Conv2D(c2, 3, padding=1, activation="relu", in_channels=c1),
                    gluon.nn.MaxPool2D(2),
                    gluon.nn.Conv2D(c3, 3, padding=1, activation="relu", in_channels=c2),
                    gluon.nn.MaxPool2D(2),
                    gluon.nn.Flatten(),
                    gluon.nn.Dense(spec["hidden"], activation="relu", in_units=c3 * size * size),
                    gluon.nn.Dense(spec["classes"], in_units=spec["hidden"]))

        def make_input(rng, batch):
            return nd.array(rng.standard_normal((batch,) + tuple(spec["image"])).astype(np.float32))
    elif name in ("transformer", "narrow"):  # the same encoder, of other sizes
        net = _Transformer(prefix=f"{name}_", **spec)

        def make_input(rng, batch):
            return nd.array(rng.integers(0, spec["vocab"], size=(batch, spec["seq"])).astype(np.float32))
    else:  # pragma: no cover - argparse restricts the choices
        raise ValueError(f"unknown model {name!r}")
    return net, make_input, spec["classes"]


def _setup(model: str, batch: int, seed: int):
    mx.random.seed(0)
    net, make_input, classes = build_model(model)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    rng = np.random.default_rng(seed)
    x = make_input(rng, batch)
    y = nd.array(rng.integers(0, classes, size=batch).astype(np.float32))
    return net, x, y


def _stepper(net, trainer, x, y, wait_before_step: bool):
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    batch = x.shape[0]

    def step():
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        if wait_before_step:
            nd.waitall()  # no overlap: every gradient exists before the first is submitted
        trainer.step(batch)

    return step


def _time(step, warmup: int, steps: int, sync=None):
    """(wall seconds, CPU seconds of this process) for ``steps`` steps after ``warmup``."""
    for _ in range(warmup):
        step()
    nd.waitall()
    if sync is not None:
        sync()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    nd.waitall()
    return time.perf_counter() - start, time.process_time() - cpu


def _combine(per_rank):
    """The job's figure from every rank's (wall, cpu): the slowest wall time, the mean CPU time."""
    return max(w for w, _ in per_rank), sum(c for _, c in per_rank) / len(per_rank)


# ---- the modes on the MPI ranks ------------------------------------------------------------------
def _polite_barrier(comm) -> None:
    """Wait for every rank without spinning a core (MPICH's blocking calls spin)."""
    if comm is None:
        return
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.005)


def _gather(comm, mine):
    if comm is None:
        return [mine]
    _polite_barrier(comm)
    return comm.allgather(mine)


def _measure(args, hvd, comm, size: int) -> dict:
    """Interleaved repeats: aiacc modes with the engine running, then the engine shut down for
    ``compute`` (an idle engine still costs CPU here: it negotiates every cycle) and dist_sync.
    The first repeat runs on the engine ``main`` started."""
    rank = hvd.rank()
    net, x, y = _setup(args.model, args.batch_size, seed=rank)
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    opt = {"learning_rate": 0.01, "momentum": 0.9}
    plain = gluon.Trainer(net.collect_params(), "sgd", dict(opt), kvstore=None)
    dist = hvd.DistributedTrainer(net.collect_params(), "sgd", dict(opt))
    steppers = {"compute": _stepper(net, plain, x, y, wait_before_step=False),
                "aiacc": _stepper(net, dist, x, y, wait_before_step=False),
                "aiacc-no-overlap": _stepper(net, dist, x, y, wait_before_step=True)}
    times = {m: [] for m in MODES}
    why_not = "skipped (--kvstore off)" if args.kvstore == "off" else None
    for repeat in range(args.repeats):
        if repeat:
            hvd.init()
        for mode in MODES[1:]:
            mine = _time(steppers[mode], args.warmup, args.steps, sync=hvd.barrier)
            times[mode].append(_combine(hvd.allgather_object(mine, name=f"time.{mode}")))
        hvd.shutdown()
        mine = _time(steppers["compute"], args.warmup, args.steps, sync=lambda: _polite_barrier(comm))
        times["compute"].append(_combine(_gather(comm, mine)))
        if why_not is None and rank == 0:
            found, why_not = _run_dist_sync(args, size)
            if found is not None:
                times.setdefault(PS, []).extend(found)
        _polite_barrier(comm)
    return times, why_not, len(net.collect_params().keys())


# ---- MXNet's dist_sync kvstore (rank 0 starts a local ps-lite job) ----------------------------
def _child_env(role: str, workers: int, port: int) -> dict:
    drop = ("PMI_", "PMIX_", "HYDRA_", "MPIR_", "MPI_", "AIACC_", "DMLC_", "OMPI_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update({"DMLC_ROLE": role, "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port),
                "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": str(workers), "DMLC_NODE_HOST": "127.0.0.1",
                "OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1", "PYTHONUNBUFFERED": "1"})
    return env


def _run_dist_sync(args, workers: int):
    """(list of times, None) or (None, why it could not run)."""
    port = free_port("127.0.0.1")
    base = [sys.executable, "-m", "aiacc.bench.train_mxnet", "--framework", "mxnet", "--model", args.model,
            "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--repeats", "1"]
    procs = []
    # Each ps-lite process runs in a session of its own: it can be killed as a group, and no
    # signal sent to its process group reaches this MPI rank. Without it this rank was ended by
    # a SIGTERM in 3 of 7 runs under aiaccrun (sender not pinned down); with it, in none of the
    # 15 runs since.
    try:
        for role in ["scheduler", "server"] + ["worker"] * workers:
            procs.append(subprocess.Popen(base + ["--dist-role", role], env=_child_env(role, workers, port),
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
        deadline = time.monotonic() + args.dist_timeout
        outputs = []
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append((p.returncode, out))
    except subprocess.TimeoutExpired:
        return None, f"the dist_sync job did not finish within {args.dist_timeout:.0f} s"
    except OSError as exc:
        return None, f"could not start the ps-lite processes: {exc}"
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the whole session of that process
                p.wait()
    for code, out in outputs:
        for line in out.splitlines():
            if line.startswith("{") and '"dist_sync_times"' in line:
                return [tuple(t) for t in json.loads(line)["dist_sync_times"]], None
    tails = "; ".join(f"exit {code}: {out.strip().splitlines()[-1] if out.strip() else '(no output)'}"
                      for code, out in outputs)
    return None, f"no worker reported times ({tails})"


def _dist_worker(args) -> int:
    kv = mx.kv.create("dist_sync")
    net, x, y = _setup(args.model, args.batch_size, seed=kv.rank)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9}, kvstore=kv)
    step = _stepper(net, trainer, x, y, False)
    times = []
    for _ in range(args.repeats):
        # every worker's step() blocks on the others (pull after a synchronous push), so the
        # workers run in lock step; the barrier aligns the start of each measurement
        times.append(_time(step, args.warmup, args.steps, sync=kv._barrier))
    if kv.rank == 0:
        print(json.dumps({"dist_sync_times": times}), flush=True)
    return 0


# ---- entry point --------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m aiacc.bench train --framework mxnet",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_args(parser)
    parser.add_argument("--kvstore", choices=["auto", "off"], default="auto",
                        help="also measure MXNet's dist_sync kvstore (auto) or not (off)")
    parser.add_argument("--dist-timeout", type=positive_float, default=600.0, help="seconds allowed for the dist_sync job")
    parser.add_argument("--dist-role", choices=["scheduler", "server", "worker"], help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.dist_role is not None:  # a process of the dist_sync job (servers never get here)
        return _dist_worker(args)

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    comm = None
    if hvd.is_enabled() and size > 1:
        from mpi4py import MPI  # noqa: PLC0415 - started by hvd.init() above

        comm = MPI.COMM_WORLD
    if "OMP_NUM_THREADS" not in os.environ and rank == 0:
        print("note: OMP_NUM_THREADS is not set; set OMP_NUM_THREADS=1 MXNET_CPU_WORKER_NTHREADS=1 "
              "for one core per rank", file=sys.stderr)
    times, why_not, tensors = _measure(args, hvd, comm, size)
    if rank != 0:
        return 0
    samples = args.steps * args.batch_size * size
    compute_ms = 1000.0 * median([wall for wall, _ in times["compute"]]) / args.steps
    records = []
    for mode in MODES[1:] + (PS,):
        if mode not in times:
            continue
        wall = median([w for w, _ in times[mode]])
        cpu = median([c for _, c in times[mode]])
        records.append({"bench": "train", "framework": "mxnet", "model": args.model, "impl": mode, "ranks": size,
                        "batch": args.batch_size, "tensors": tensors, "samples/s": samples / wall,
                        "step ms": 1000.0 * wall / args.steps, "compute ms": compute_ms,
                        "comm ms": 1000.0 * wall / args.steps - compute_ms,
                        "cpu ms/step/rank": 1000.0 * cpu / args.steps, "settings": SETTINGS[mode]})
    add_ratios(records, PS)
    emit(records, args.json, TRAIN_FIELDS + [f"vs {PS}", "cpu ms/step/rank", "settings"])
    if not args.json:
        print("cpu ms/step/rank: CPU time of a rank's process (all its threads) per step; for ps-dist_sync "
              "a worker's only (the ps-lite server's is not counted)", flush=True)
    if PS not in times:
        print(f"{PS}: not measured: {why_not}", file=sys.stderr if args.json else sys.stdout, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
