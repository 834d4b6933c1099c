"""``python -m aiacc.bench train --framework tensorflow``: samples/s of a TensorFlow training step.

    aiaccrun -np 2 python -m aiacc.bench train --framework tensorflow --model cnn
    aiaccrun -np 2 python -m aiacc.bench train --framework tensorflow --model transformer
    aiaccrun -np 2 python -m aiacc.bench train --framework tensorflow --model narrow

Builds the models of ``aiacc.bench.common.MODELS`` with Keras layers and times one ``tf.function``
training step (SGD) per implementation, each on the same model and data, in the same processes:

  aiacc           ``DistributedGradientTape``: each gradient handed to its bucket as TensorFlow
                  produces it, each bucket to the engine when its last gradient is in
  tf-mwms         the baseline a TensorFlow user picks: ``tf.distribute.MultiWorkerMirroredStrategy``
                  with its collective ops (defaults: ``CommunicationImplementation.AUTO``, ring on CPU),
                  ``strategy.run`` of the same step, workers from ``TF_CONFIG`` made here from MPI ranks
  aiacc-blocking  (an internal row) one blocking ``grouped_allreduce`` of all gradients after the whole
                  gradient list exists: what aiacc's overlap adds over not overlapping

and the same step without communication (``compute ms`` on every row; ``comm ms`` = step - compute).
Each rank uses one intra-op and one inter-op thread (``--threads``). Figures are medians of
``--repeats`` measurements of ``--steps`` steps, the implementations taking turns so that each sees
the same machine load; ``vs tf-mwms`` is the ratio of the medians' samples/s. Rank 0 prints them.

Per step on rank 0: ``requests``, the operations handed to aiacc's engine (counted over ``--steps``
untimed steps after the warm-up); ``engine cpu ms``, the CPU time of aiacc's engine thread (its
``CLOCK_THREAD_CPUTIME_ID``, read from the training thread); ``cycle cpu ms``, the CPU of every engine
cycle on whichever thread ran it (a thread waiting for a handle runs cycles itself; ``aiacc.summary()``'s
``cycle_cpu_seconds``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import numpy as np

from aiacc.bench.common import (MODELS, TRAIN_FIELDS, add_ratios, add_train_args, cycle_cpu, emit, engine_cpu,
                                free_port, median, parse_impls, positive_int)

IMPLS = ("aiacc", "tf-mwms", "aiacc-blocking")


def build_model(name: str):
    """The benchmark model ``name`` of ``MODELS`` as a Keras model (channels-last images)."""
    import keras  # noqa: PLC0415

    spec = MODELS[name]
    layers = keras.layers
    if name == "cnn":
        c, h, w = spec["image"]
        c1, c2, c3 = spec["channels"]
        return keras.Sequential([
            keras.Input((h, w, c)),
            layers.Conv2D(c1, 3, padding="same", activation="relu"),
            layers.Conv2D(c2, 3, padding="same", activation="relu"),
            layers.MaxPooling2D(2),
            layers.Conv2D(c3, 3, padding="same", activation="relu"),
            layers.MaxPooling2D(2),
            layers.Flatten(),
            layers.Dense(spec["hidden"], activation="relu"),
            layers.Dense(spec["classes"]),
        ], name="cnn")
    # transformer and narrow: the same encoder, of other sizes
    d = spec["d_model"]
    tokens = keras.Input((spec["seq"],), dtype="int32")
    x = layers.Embedding(spec["vocab"], d)(tokens)
    for _ in range(spec["layers"]):  # post-norm encoder layers
        attn = layers.MultiHeadAttention(spec["heads"], d // spec["heads"])(x, x)
        x = layers.LayerNormalization()(x + attn)
        ff = layers.Dense(d)(layers.Dense(spec["ff"], activation="relu")(x))
        x = layers.LayerNormalization()(x + ff)
    x = layers.GlobalAveragePooling1D()(x)
    return keras.Model(tokens, layers.Dense(spec["classes"])(x), name=name)


def _batch(name: str, batch: int, seed: int):
    spec = MODELS[name]
    rng = np.random.default_rng(seed)
    if name == "cnn":
        c, h, w = spec["image"]
        x = rng.standard_normal((batch, h, w, c)).astype(np.float32)
    else:
        x = rng.integers(0, spec["vocab"], size=(batch, spec["seq"])).astype(np.int32)
    return x, rng.integers(0, spec["classes"], size=batch).astype(np.int32)


@contextlib.contextmanager
def _counting_requests():
    """Counts the operations submitted to aiacc's engine inside the block (``counter[0]``)."""
    import aiacc  # noqa: PLC0415

    engine = aiacc.get_engine()
    counter = [0]
    if engine is None:
        yield counter
        return
    submit = engine.submit

    def counted(*args, **kwargs):
        counter[0] += 1
        return submit(*args, **kwargs)

    engine.submit = counted  # on this instance only, for the untimed counting steps
    try:
        yield counter
    finally:
        del engine.submit


def _step_fn(mode, model, opt, loss_fn, hvd):
    import tensorflow as tf  # noqa: PLC0415

    variables = model.trainable_variables

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        if mode == "aiacc":
            tape = hvd.DistributedGradientTape(tape, name="bench")
        grads = tape.gradient(loss, variables)
        if mode == "aiacc-blocking":
            grads = hvd.grouped_allreduce(grads, name="bench.grouped")
        opt.apply_gradients(zip(grads, variables))
        return loss

    return step


def _mwms_strategy(rank: int, ports):
    """MultiWorkerMirroredStrategy over these processes: TF_CONFIG from the ranks' ports. It has to
    exist before TensorFlow's runtime starts, so it is made before anything else touches TF."""
    import tensorflow as tf  # noqa: PLC0415

    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                          "task": {"type": "worker", "index": rank}})
    try:
        return tf.distribute.MultiWorkerMirroredStrategy()
    finally:
        del os.environ["TF_CONFIG"]  # read once, at creation


def _mwms_step_fn(strategy, name: str, batch: int, size: int):
    """The same model and step under the strategy: gradients summed by its collective ops (the loss
    scaled by the global batch, as its documentation prescribes), then the same SGD update."""
    import keras  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_model(name)
        opt = keras.optimizers.SGD(0.01)
    per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(per_example(y, model(x, training=True)), global_batch_size=batch * size)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step(x, y):
        return strategy.run(replica_step, args=(x, y))

    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aiacc.bench train --framework tensorflow",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_args(parser)
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of " + ",".join(IMPLS))
    parser.add_argument("--threads", type=positive_int, default=1, help="TensorFlow intra- and inter-op threads per rank")
    args = parser.parse_args(argv)
    impls = parse_impls(parser, args.impls, IMPLS)

    import aiacc  # noqa: PLC0415

    aiacc.init()  # MPI only: the strategy must come before TensorFlow's runtime starts
    ports = aiacc.allgather_object(free_port("127.0.0.1"), name="bench.mwms.ports") if "tf-mwms" in impls else None
    import tensorflow as tf  # noqa: PLC0415

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    tf.get_logger().setLevel("ERROR")
    strategy = _mwms_strategy(aiacc.rank(), ports) if ports else None
    import keras  # noqa: PLC0415

    import aiacc.tensorflow as hvd  # noqa: PLC0415

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    keras.utils.set_random_seed(0)
    model = build_model(args.model)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = (tf.constant(a) for a in _batch(args.model, args.batch_size, seed=rank))
    params = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    steps = {}
    for mode in ["compute"] + impls:  # trace and warm up every mode first
        if mode == "tf-mwms":
            steps[mode] = _mwms_step_fn(strategy, args.model, args.batch_size, size)
        else:
            steps[mode] = _step_fn(mode, model, keras.optimizers.SGD(0.01), loss_fn, hvd)
            if mode != "compute":  # (the compute steps trained each rank on its own batch: one model again)
                hvd.broadcast_variables(model.variables, root_rank=0)
        # (aiacc's modes: 2 steps at least, so that the tape compares the ranks' variables, at its second step, here
        # after the broadcast, not in the counted steps after the compute steps made them differ again)
        for _ in range(max(1 if mode in ("compute", "tf-mwms") else 2, args.warmup)):
            steps[mode](x, y)
    requests = {}
    for mode in steps:
        with _counting_requests() as counter:
            for _ in range(args.steps):
                loss = steps[mode](x, y)
            _wait(loss)
        requests[mode] = counter[0] / args.steps
    times = {mode: [] for mode in steps}
    engine_used = {mode: [] for mode in steps}
    cycle_used = {mode: [] for mode in steps}
    for i in range(args.repeats):  # modes take turns (reversed every other repeat): each sees the same load
        for mode in (list(steps) if i % 2 == 0 else list(steps)[::-1]):
            hvd.barrier()
            start, cpu, cycles = time.perf_counter(), engine_cpu(), cycle_cpu()
            for _ in range(args.steps):
                loss = steps[mode](x, y)
            _wait(loss)
            times[mode].append(time.perf_counter() - start)
            engine_used[mode].append(engine_cpu() - cpu)
            cycle_used[mode].append(cycle_cpu() - cycles)
    compute_ms = 1e3 * median(times["compute"]) / args.steps
    records = []
    for mode in impls:
        t = median(times[mode])
        step_ms = 1e3 * t / args.steps
        records.append({"bench": "train", "framework": "tensorflow", "model": args.model, "impl": mode,
                        "ranks": size, "batch": args.batch_size, "params": params,
                        "tensors": len(model.trainable_variables),
                        "samples/s": args.batch_size * size * args.steps / t, "step ms": step_ms,
                        "compute ms": compute_ms, "comm ms": step_ms - compute_ms, "requests": requests[mode],
                        "engine cpu ms": 1e3 * median(engine_used[mode]) / args.steps,
                        "cycle cpu ms": 1e3 * median(cycle_used[mode]) / args.steps,
                        "settings": "defaults" if mode != "aiacc-blocking" else "one grouped_allreduce per step"})
    add_ratios(records, "tf-mwms")
    if rank == 0:
        emit(records, args.json, TRAIN_FIELDS + ["vs tf-mwms", "requests", "engine cpu ms", "cycle cpu ms",
                                                 "settings"])
    hvd.shutdown()
    return 0


def _wait(loss) -> None:
    """Until the step's result exists (a strategy's result is per replica)."""
    import tensorflow as tf  # noqa: PLC0415

    for value in tf.nest.flatten(getattr(loss, "values", loss)):
        float(tf.reduce_sum(value))
