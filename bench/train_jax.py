"""``python -m aiacc.bench train --framework jax``: samples/s of a Keras 3 training step on JAX's backend.

    aiaccrun -np 2 python -m aiacc.bench train --framework jax --model cnn
    aiaccrun -np 2 python -m aiacc.bench train --framework jax --model transformer
    aiaccrun -np 2 python -m aiacc.bench train --framework jax --model narrow

Sets ``KERAS_BACKEND=jax`` itself. Builds the models of ``aiacc.bench.common.MODELS`` with Keras layers
(``aiacc.bench.train_tensorflow.build_model``: plain Keras, any backend) and times Keras' own compiled
train step (``model.train_on_batch``, SGD, cross-entropy) per implementation, each on the same model and
data, in the same processes:

  aiacc    ``aiacc.keras.DistributedOptimizer``: the step's gradients leave the compiled step through one
           host callback, packed as one flat array per dtype, and are averaged there
  jax-dp   what a Keras-on-JAX user picks: ``keras.distribution.DataParallel`` over the devices of every
           process (JAX's multi-process runtime, ``keras.distribution.initialize``, its coordinator on
           rank 0's host) with JAX's gloo CPU collectives: XLA sums the gradients inside the compiled step;
           each process hands in its own batch (Keras makes the global batch of them)

and the same step without communication (``compute ms`` on every row; ``comm ms`` = step - compute).
Each rank's XLA runs on one core (``--xla-threads``, the Eigen pool, like the other benches' one thread per
rank). Figures are medians of ``--repeats`` measurements of ``--steps`` steps, the implementations taking
turns so that each sees the same load; ``vs jax-dp`` is the ratio of the medians' samples/s. Rank 0 prints
them. ``cycle cpu ms``: the CPU time of aiacc's cycles per step (``aiacc.summary()``'s
``cycle_cpu_seconds``; on this path the host callback's thread runs them, not the engine thread).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from aiacc.bench.common import (TRAIN_FIELDS, add_ratios, add_train_args, emit, free_port, median,
                                parse_impls, positive_int)

IMPLS = ("aiacc", "jax-dp")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aiacc.bench train --framework jax", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_args(parser)
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of " + ",".join(IMPLS))
    parser.add_argument("--xla-threads", type=positive_int, default=1, help="XLA CPU threads per rank")
    args = parser.parse_args(argv)
    impls = parse_impls(parser, args.impls, IMPLS)
    if "keras" in sys.modules and os.environ.get("KERAS_BACKEND") != "jax":
        raise SystemExit("aiacc.bench train --framework jax: Keras was imported on another backend first")
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen="
                               + ("true" if args.xla_threads > 1 else "false")
                               + f" intra_op_parallelism_threads={args.xla_threads}").strip()

    import aiacc  # noqa: PLC0415

    aiacc.init()
    rank, size = aiacc.rank(), aiacc.size()
    import jax  # noqa: PLC0415
    import keras  # noqa: PLC0415

    dp = None
    if "jax-dp" in impls:  # JAX's runtime must span the processes before any computation
        port = aiacc.broadcast_object(free_port("127.0.0.1") if rank == 0 else None, 0, name="bench.jax.port")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        keras.distribution.initialize(f"127.0.0.1:{port}", num_processes=size, process_id=rank)
        dp = keras.distribution.DataParallel(devices=jax.devices())

    import aiacc.keras as hvd  # noqa: PLC0415

    from .train_tensorflow import _batch, build_model  # noqa: PLC0415

    hvd.init()
    x, y = _batch(args.model, args.batch_size, seed=rank)

    def compiled(optimizer):
        keras.utils.set_random_seed(0)
        model = build_model(args.model)
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    models = {"compute": compiled(keras.optimizers.SGD(0.01))}
    if "aiacc" in impls:
        models["aiacc"] = compiled(hvd.DistributedOptimizer(keras.optimizers.SGD(0.01), name="bench"))
    if dp is not None:
        with dp.scope():
            models["jax-dp"] = compiled(keras.optimizers.SGD(0.01))
    params = int(sum(np.prod(v.shape) for v in models["compute"].trainable_variables))

    def run(mode, steps):
        model = models[mode]
        if mode == "jax-dp":
            with dp.scope():
                for _ in range(steps):
                    model.train_on_batch(x, y)  # (returns the loss as a number: the step has finished)
        else:
            for _ in range(steps):
                model.train_on_batch(x, y)

    for mode in models:  # compile and warm up every mode first
        run(mode, max(1, args.warmup))
    times = {mode: [] for mode in models}
    cycle_cpu = {mode: [] for mode in models}
    for i in range(args.repeats):  # modes take turns (reversed every other repeat): each sees the same load
        for mode in (list(models) if i % 2 == 0 else list(models)[::-1]):
            hvd.barrier()
            start, cpu = time.perf_counter(), hvd.summary()["cycle_cpu_seconds"]
            run(mode, args.steps)
            times[mode].append(time.perf_counter() - start)
            cycle_cpu[mode].append(hvd.summary()["cycle_cpu_seconds"] - cpu)
    compute_ms = 1e3 * median(times["compute"]) / args.steps
    records = []
    for mode in impls:
        t = median(times[mode])
        step_ms = 1e3 * t / args.steps
        records.append({"bench": "train", "framework": "jax", "model": args.model, "impl": mode, "ranks": size,
                        "batch": args.batch_size, "params": params,
                        "tensors": len(models["compute"].trainable_variables),
                        "samples/s": args.batch_size * size * args.steps / t, "step ms": step_ms,
                        "compute ms": compute_ms, "comm ms": step_ms - compute_ms,
                        "cycle cpu ms": 1e3 * median(cycle_cpu[mode]) / args.steps, "settings": "defaults"})
    add_ratios(records, "jax-dp")
    if rank == 0:
        emit(records, args.json, TRAIN_FIELDS + ["vs jax-dp", "cycle cpu ms", "settings"])
    hvd.shutdown()
    return 0
