"""``python -m aiacc.bench train --framework tensorflow``: samples/s of a TensorFlow training step.

    aiaccrun -np 2 python -m aiacc.bench train --framework tensorflow --model cnn
    aiaccrun -np 2 python -m aiacc.bench train --framework tensorflow --model transformer
    aiaccrun -np 2 python -m aiacc.bench train --framework tensorflow --model narrow

Builds the models of ``aiacc.bench.common.MODELS`` with Keras layers and times one ``tf.function``
training step (SGD) in three modes, each on the same model and data:

  compute   forward, backward and update without any communication (the ceiling)
  blocking  one blocking grouped allreduce of all gradients after the whole gradient list exists
  overlap   ``DistributedGradientTape``: each gradient handed to its bucket as TensorFlow produces it, each
            bucket to the engine when its last gradient is in

Each rank uses one intra-op and one inter-op thread (``--threads``). Figures are medians of
``--repeats`` measurements of ``--steps`` steps, the modes interleaved so that each sees the same
machine load; rank 0 prints them. Nothing is asserted.

Per step on rank 0: ``requests``, the operations handed to the engine (counted over ``--steps``
untimed steps after the warm-up); ``engine cpu ms``, the CPU time of aiacc's engine thread (its
``CLOCK_THREAD_CPUTIME_ID``, read from the training thread), what the communication costs a CPU
that the training thread needs. ``compute`` runs with the engine idle (it still negotiates empty
cycles now and then).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import numpy as np

from aiacc.bench.common import MODELS, add_train_args, emit, median

MODES = ("compute", "blocking", "overlap")


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


def _engine_cpu() -> float:
    """CPU seconds aiacc's engine thread has used so far."""
    import aiacc  # noqa: PLC0415

    engine = aiacc.get_engine()
    return 0.0 if engine is None else time.clock_gettime(time.pthread_getcpuclockid(engine._thread.ident))


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
        if mode == "overlap":
            tape = hvd.DistributedGradientTape(tape, name="bench")
        grads = tape.gradient(loss, variables)
        if mode == "blocking":
            grads = hvd.grouped_allreduce(grads, name="bench.grouped")
        opt.apply_gradients(zip(grads, variables))
        return loss

    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aiacc.bench train --framework tensorflow",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_args(parser)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    parser.add_argument("--threads", type=int, default=1, help="TensorFlow intra- and inter-op threads per rank")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            parser.error(f"--modes: unknown mode {m!r}; choose from {', '.join(MODES)}")

    import tensorflow as tf  # noqa: PLC0415

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    tf.get_logger().setLevel("ERROR")
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
    for mode in modes:  # trace and warm up every mode first
        steps[mode] = _step_fn(mode, model, keras.optimizers.SGD(0.01), loss_fn, hvd)
        for _ in range(max(1, args.warmup)):
            steps[mode](x, y)
    requests = {}
    for mode in modes:
        with _counting_requests() as counter:
            for _ in range(args.steps):
                loss = steps[mode](x, y)
            float(loss)
        requests[mode] = counter[0] / args.steps
    times = {mode: [] for mode in modes}
    engine_cpu = {mode: [] for mode in modes}
    for _ in range(args.repeats):  # modes interleaved, so that each sees the same machine load
        for mode in modes:
            hvd.barrier()
            start, cpu = time.perf_counter(), _engine_cpu()
            for _ in range(args.steps):
                loss = steps[mode](x, y)
            float(loss)
            times[mode].append(time.perf_counter() - start)
            engine_cpu[mode].append(_engine_cpu() - cpu)
    records = []
    for mode in modes:
        t = median(times[mode])
        records.append({"bench": "train", "framework": "tensorflow", "model": args.model, "mode": mode,
                        "ranks": size, "batch_per_rank": args.batch_size,
                        "samples_per_s": args.batch_size * size * args.steps / t,
                        "step_ms": 1e3 * t / args.steps, "params": params,
                        "tensors": len(model.trainable_variables), "requests": requests[mode],
                        "engine cpu ms": 1e3 * median(engine_cpu[mode]) / args.steps})
    if rank == 0:
        emit(records, args.json, ["framework", "model", "mode", "ranks", "batch_per_rank", "samples_per_s",
                                  "step_ms", "params", "tensors", "requests", "engine cpu ms"])
    hvd.shutdown()
    return 0
